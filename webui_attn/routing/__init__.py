"""How each webui's attention reaches the engine, recognised by what the running webui has (``detect``)."""
