"""The exception types users see: a clear, one-line message about their input."""


class KilnError(Exception):
    """Bad input or an unsupported feature; the CLI prints it on one line and exits with code 2."""


class ParamError(KilnError, ValueError):
    """A request parameter is invalid; `param` names it (the server's 400 reports it as is)."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


class ContextLengthError(ParamError):
    """A prompt, with the tokens asked of it, does not fit the model's context or the KV cache."""


class QueueFull(KilnError):
    """As many requests wait as the engine takes: retry later (the server's 429)."""
    status = 429


class NoChatTemplate(KilnError, ValueError):
    """The model has no chat template, so chat messages cannot be turned into a prompt."""
