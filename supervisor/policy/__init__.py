"""Pure decisions: no asyncio, no I/O, no clock reads (time is passed in).

Imports nothing else of the package.
"""
