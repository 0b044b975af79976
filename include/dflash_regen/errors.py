"""One exception tree for the pipeline: every class this package raises on purpose lives here.

Every message says what happened, with which value, and what to do next. `tasks.fail_fast` turns every
`NotRetryable` into a non-retryable task failure (retrying cannot fix it) and every `Skipped` into a skipped
task; the rest fail the task attempt and Airflow's retries (or a clear) try again.

    DflashError
    ├── NotRetryable                 same inputs, same failure
    │   ├── ConfigError (ValueError) a Param or input is invalid: field, value, rule
    │   │   ├── VersionRefused       SGLang version cannot run this launch
    │   │   └── PlanFailed           too many bad rows, or nothing to plan
    │   ├── PromptSourceError (ValueError)   the prompt source itself is unusable
    │   ├── TokenizeError (ValueError)       tokenizer or chat template unusable
    │   ├── StagingError             weights could not be staged
    │   ├── GateFailed               a fleet gate rejected servers
    │   ├── PublishRefused           counts do not reconcile
    │   ├── LaunchRefused (FleetError)       port taken, flag unknown
    │   ├── RunLocked                another live run holds the output root
    │   ├── DiskFull                 no space left where a result is written (atomic.py)
    │   ├── AuthError                a server refuses our API key
    │   └── TooManyPromptErrors      more refused prompts than Param max_generate_error_share
    ├── FleetError                   a server did not launch, get ready, or stop
    ├── CapacityError                the fleet could not be measured
    │   └── TooFewPrompts
    ├── MetricsMissing               a server without --enable-metrics
    ├── TransientError               a request may succeed if sent again
    │   └── ServerError              HTTP 5xx
    ├── PromptError                  HTTP 4xx for this prompt
    ├── Cancelled                    a stream stopped by its caller
    ├── ServerUnhealthy              the leased server stopped answering
    ├── NoServerFree                 every healthy server is leased
    ├── ShardFailed                  a shard stopped on its server (results kept)
    ├── Skipped                      not a failure: the task has nothing to do
    │   ├── Drained                  the operator drained the run
    │   └── NothingToGenerate        the completion store holds every prompt's completion
    ├── SchemaError (ValueError)     a tool schema that cannot be repaired (a quarantine reason)
    └── RunNotFound (LookupError)    no run folder of that id
"""

import json


class DflashError(Exception):
    """Base of every error this package raises on purpose."""


class NotRetryable(DflashError):
    """Deterministic: the same inputs fail the same way (a busy port, an unknown flag, a wrong API key)."""


# --------------------------------------------------------------------------------------- inputs and Params
class ConfigError(NotRetryable, ValueError):
    """A run parameter is invalid: names the field, the value and the rule."""


class VersionRefused(ConfigError):
    """The server's SGLang version cannot run this launch (known-bad, too old): says why and what to install."""


class PlanFailed(ConfigError):
    """Too many bad rows, or nothing to plan: fix the input rather than retry."""


class PromptSourceError(NotRetryable, ValueError):
    """The prompt source itself is unusable (missing, unsupported files, unreadable JSON array)."""


class SchemaError(DflashError, ValueError):
    """A tool schema that cannot be repaired: where inside it, what value, and what to write instead."""

    def __init__(self, path: str, value, fix: str):
        shown = json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else repr(value)
        super().__init__(f"{path} is {shown[:120]}: {fix}")


class TokenizeError(NotRetryable, ValueError):
    """A tokenizer could not be loaded, or a conversation cannot be rendered by the chat template."""


class RunLocked(NotRetryable):
    """Another live run holds the output root."""


class DiskFull(NotRetryable):
    """No space left for a result: names the path, what it needs and what is free. A retry would meet the same
    full disk; once space is freed, a clear resumes from what is on disk (every write is whole or absent)."""


class RunNotFound(DflashError, LookupError):
    """No run folder of that id under the output root (or the id tries to leave it)."""


# ------------------------------------------------------------------------------------------ weights, fleet
class StagingError(NotRetryable):
    """Model weights could not be staged (space, missing files, checksum mismatch)."""


class FleetError(DflashError):
    """A server could not be launched, did not become ready, or could not be stopped."""


class LaunchRefused(FleetError, NotRetryable):
    """The fleet cannot start with these Params or on this host as it is (port taken, flag unknown)."""


class GateFailed(NotRetryable):
    """A fleet gate (allocation health check or smoke test) rejected one or more servers."""


class CapacityError(DflashError):
    """The fleet could not be measured (no metrics, no answers, no prompts)."""


class TooFewPrompts(CapacityError):
    """The run is smaller than one calibration: there is nothing worth predicting."""


class MetricsMissing(DflashError):
    """The server has no /metrics endpoint (launched without --enable-metrics)."""


# ------------------------------------------------------------------------------------- requests to SGLang
class TransientError(DflashError):
    """The request may succeed if sent again (possibly to another server)."""


class ServerError(TransientError):
    """HTTP 5xx: usually transient, but the same answer to one prompt on two servers makes it the prompt's."""

    def __init__(self, status: int, message: str, base_url: str):
        super().__init__(f"HTTP {status} from {base_url}: {message}")
        self.status, self.message = status, message


class AuthError(NotRetryable):
    """HTTP 401/403: the server refuses our API key; no prompt and no retry can fix that."""


class PromptError(DflashError):
    """The server rejected this prompt (HTTP 4xx); sending it again will not help."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class Cancelled(DflashError):
    """The caller's stop event was set mid-stream; the connection is closed, so SGLang aborts the request."""


# ------------------------------------------------------------------------------------------------- shards
class ServerUnhealthy(DflashError):
    """The leased server stopped answering; the task fails so its retry leases another one."""


class NoServerFree(DflashError):
    """Every healthy server is leased by another shard task (or none is healthy)."""


class TooManyPromptErrors(NotRetryable):
    """More of a shard's prompts were refused by the servers than Param max_generate_error_share allows."""


class Skipped(DflashError):
    """Not a failure: the task has nothing to do, and is skipped (`tasks.fail_fast`); the message says why."""


class NothingToGenerate(Skipped):
    """The completion store holds every planned prompt's completion: no weights staged, no fleet launched."""


class Drained(Skipped):
    """The operator drained the run: the shard finished its in-flight requests, checkpointed them and stopped;
    its task is skipped, and a clear (or a new run, which reuses its completions) sends the rest."""


class ShardFailed(DflashError):
    """A shard stopped on its server; its checkpointed results are kept and a retry sends only the rest."""


class PublishRefused(NotRetryable):
    """The run's files are inconsistent (counts do not reconcile): nothing is published."""
