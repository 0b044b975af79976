"""One exception tree for the pipeline.

Every message says what happened, with which value, and what to do next. Task adapters turn
`ConfigError`, `GateFailed`, `StagingError` and every `NotRetryable` into non-retryable task failures:
retrying cannot fix them.
"""


class DflashError(Exception):
    """Base of every error this package raises on purpose."""


class NotRetryable(DflashError):
    """Deterministic: the same inputs fail the same way (a busy port, an unknown flag, a wrong API key)."""


class ConfigError(DflashError, ValueError):
    """A run parameter is invalid: names the field, the value and the rule."""


class VersionRefused(ConfigError):
    """The server's SGLang version cannot run this launch (known-bad, too old): says why and what to install."""


class StagingError(DflashError):
    """Model weights could not be staged (space, missing files, checksum mismatch)."""


class FleetError(DflashError):
    """A server could not be launched, did not become ready, or could not be stopped."""


class GateFailed(DflashError):
    """A fleet gate (allocation health check or smoke test) rejected one or more servers."""


class PublishRefused(DflashError):
    """The run's files are inconsistent (counts do not reconcile): nothing is published."""


class LaunchRefused(FleetError, NotRetryable):
    """The fleet cannot start with these Params or on this host as it is (port taken, flag unknown)."""


class RunLocked(NotRetryable):
    """Another live run holds the output root."""
