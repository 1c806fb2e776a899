"""What requests are sent to: the children (child processes and their effects), the engine that owns
each upstream's lifecycle, the process and clock seams, and this machine's CPU.
"""
