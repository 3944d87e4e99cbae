"""The HTTP shell around the core: the aiohttp app, the inference handler, the relay to
backends, each pool's run-time state and health probes, metrics, logs and the server."""
