"""keygate's wire protocols: one package per protocol (sans-IO codec and connection
machine, asyncio listener), the ``sink`` boundary to the gateway, and the listeners'
shared kit (``_io``, ``_limits``, ``_log``). Import the packages."""

__all__: list[str] = []
