"""The errors a user's input raises, and the one that ends an engine, in a module of their own so that every subsystem can
raise them without importing the modules that validate whole configurations or requests
(config.py imports the registries of moe/ to check names against; those raise ConfigError)."""


class ConfigError(ValueError):
    """A user-facing configuration mistake; its message says what to change."""


class InvalidRequest(ValueError):
    """A request refused before it joins a batch; `param` names the field at fault (OpenAI's
    `param`: "temperature", "prompt", "max_tokens", ...)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class EngineFailed(RuntimeError):
    """The engine cannot step any more (a rank of several died): whoever drives it stops."""
