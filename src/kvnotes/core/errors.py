"""One family of user-facing errors. Messages say what went wrong and how to fix the call."""


class KvnotesError(Exception):
    """Base class for every error kvnotes raises on bad input or a missing resource."""


class UnknownModelError(KvnotesError, ValueError):
    """A model alias, directory or file that cannot be resolved."""


class NotebookMismatchError(KvnotesError, ValueError):
    """A notebook used with (or loaded into) a model other than the one that wrote it."""


class NotebookFileError(KvnotesError, OSError):
    """A notebook or skill file that is truncated, tampered with or not a kvnotes file."""


class PositionError(KvnotesError, ValueError):
    """Positions outside what the model supports, or a shift the position scheme cannot do."""


class UnsupportedModelError(KvnotesError, ValueError):
    """An architecture or position scheme kvnotes cannot handle for the requested operation."""


class EmptyInputError(KvnotesError, ValueError):
    """Empty text, ids or documents where at least one token is required."""


class UnknownFieldError(KvnotesError, KeyError):
    """A field name that the document or notebook does not have."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""
