"""What can run where, now: the pool (leases, the waiting line), the capacity behind admission
(resources.py), which pool serves a request (pools.py).
"""
