"""keygate's running process: the broker (the protocols' Sink), group runtimes, the admin
API and console, the CLI, and the native SDK (``gateway.client``). Import the modules."""

__all__: list[str] = []
