"""Errors a stage knows how to explain: the CLI prints them as one line and exits 1 (:data:`EXIT_PERMANENT` for a
:class:`PermanentError`)."""

from __future__ import annotations


class PipelineError(Exception):
    """A failure with a clear cause and remedy; the message names the file, key or line."""


class ConfigError(PipelineError):
    """Bad keys in a settings file (or the environment, ``source``): one line per problem, each naming its key."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source, self.problems = source, list(problems)
        listing = "".join(f"\n  - {p}" for p in self.problems)
        super().__init__(f"{source}: {self.problems[0]}" if len(self.problems) == 1
                         else f"{source}: {len(self.problems)} problem(s) in the configuration:{listing}")


class DataError(PipelineError):
    """An input file is malformed (bad UTF-8, misaligned pairs, empty corpus, corrupt shard...)."""


#: The exit code of a stage that failed for a reason no retry can fix (:class:`PermanentError`); the flow
#: (flows/pipeline.py) does not retry a stage that exits with it.
EXIT_PERMANENT = 78  # EX_CONFIG in sysexits.h: fixed by changing a setting or a file, never by waiting


class PermanentError(PipelineError):
    """A failure that retrying cannot fix; the stage exits with :data:`EXIT_PERMANENT` instead of 1."""


class DownloadError(PipelineError):
    """A source could not be fetched or failed its integrity checks."""


class PermanentDownloadError(DownloadError, PermanentError):
    """A download that no retry can fix: a host name that does not resolve, HTTP 4xx, an invalid URL or mirror, a
    checksum mismatch."""


class CheckpointError(PipelineError):
    """A checkpoint is missing, incomplete, corrupt or from another configuration."""


class OutputError(PipelineError):
    """An output could not be written: disk full, quota, file size limit, permission, read-only disk."""
