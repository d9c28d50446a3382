"""How the ``kvxfer`` command logs: readable lines, or JSON lines for a log pipeline.

JSON lines (``--log-format json``) are one object per record: ``time``, ``level``,
``logger``, ``message``, and every field a line adds. Each line about a transfer
carries ``transfer_id`` and ``trace_id`` (the daemon adds them); any other line
written while a traced call is served carries that call's ``trace_id``.
"""

from __future__ import annotations

import logging
from typing import Literal

from opentelemetry import trace

LogFormat = Literal["text", "json"]
FORMATS: tuple[LogFormat, ...] = ("text", "json")
TEXT = "%(asctime)s %(name)s %(levelname)s %(message)s"


class _CurrentTrace(logging.Filter):
    """Adds the current span's trace id to a record that carries none."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "trace_id", ""):
            context = trace.get_current_span().get_span_context()
            if context.is_valid:
                record.trace_id = format(context.trace_id, "032x")
        return True


def configure(level: str, log_format: LogFormat = "text") -> None:
    """Log to stderr at ``level`` in ``log_format``."""
    handler = logging.StreamHandler()
    if log_format == "json":  # the daemon's (kvxfer serve): python-json-logger comes with it
        from pythonjsonlogger.json import JsonFormatter

        handler.setFormatter(JsonFormatter(
            "%(asctime)s %(levelname)s %(name)s %(message)s",
            rename_fields={"asctime": "time", "levelname": "level", "name": "logger"}))
        handler.addFilter(_CurrentTrace())
    else:
        handler.setFormatter(logging.Formatter(TEXT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
