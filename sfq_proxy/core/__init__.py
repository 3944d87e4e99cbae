"""The sans-I/O core: every decision the proxy makes, with no asyncio, no aiohttp and no clock.

Fair queue, scheduler, placement, limits, admission, flows, cost, calibration, the parsed
request body and the errors, as plain data: the HTTP shell (``sfq_proxy.http``) and the
scenario lab (``sfq_proxy.lab``) both drive these same classes, passing the time in.
"""
