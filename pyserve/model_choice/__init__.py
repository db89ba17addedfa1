"""Choosing one of two served models for a request before it runs: a classifier over the
request's embedding (classifier.py), trained from eval results (train.py; `pyserve route-train`),
that a route (`--route NAME=FILE`) asks. The server's side, routes and cascades (a cascade lets
the small model answer first and escalates when its confidence is low), is
pyserve/server/decision.py. Not to be confused with the replica front (`pyserve router`,
pyserve/replicas, rust/router), which spreads requests over copies of the same model."""
