"""The daemon: wiring and shutdown (daemon.py), Spillway's own routes and status page, systemd,
reloads, the operator's actions, the balancer's agent port, logging.
"""
