"""llama-server front end: the aiohttp app, forwarding and error responses."""
