"""The one exception type users see: a clear, one-line message about their input."""


class KilnError(Exception):
    """Bad input or an unsupported feature; the CLI prints it on one line and exits with code 2."""
