"""`pyserve eval`: an eval set run through serving configurations, quality against cost and
latency. Built so far: the eval set's format (items.py), the scorers (scorers.py, with the
code scorer's sandbox in code_sandbox.py) and the statistics (stats.py: bootstrap confidence
intervals, the Pareto frontier)."""
