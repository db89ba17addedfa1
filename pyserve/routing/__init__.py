"""Routing and cascades between a small and a large served model: a router (router.py) sends a
request to one of them by its predicted difficulty, a classifier over the request's embedding
trained from eval results (train.py); a cascade (cascade.py) lets the small model answer first
and escalates when its confidence is low."""
