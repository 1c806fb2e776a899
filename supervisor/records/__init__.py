"""What Spillway keeps and reports: incidents, Idempotency-Keys' answers, resumable streams'
buffers, metrics, and times as the records show them.
"""
