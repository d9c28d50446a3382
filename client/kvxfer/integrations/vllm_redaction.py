"""Keeps kvxfer's transfer capabilities out of vLLM's logs.

A capability (docs/trust.md) travels in ``kv_transfer_params``, and vLLM logs those under
``--enable-log-requests``: every request's ``SamplingParams`` (their ``extra_args``) at
INFO, its JSON body at DEBUG. ``install`` is a vLLM general plugin (entry point
``vllm.general_plugins``, name ``kvxfer_redaction``), so vLLM runs it in every process it
starts, the API server included, before the first request is logged. It adds a filter that
replaces the value of every ``capabilities`` key in a record's message with
``"<redacted>"``. Only the standard library is imported here: the plugin loads in every
vLLM process, connector or not.
"""

from __future__ import annotations

import logging
import re

#: What a capabilities value is replaced with.
REDACTED = '"<redacted>"'
#: A ``capabilities`` key as Python's repr or JSON writes it, up to its value.
_KEY = re.compile(r"""["']capabilities["']\s*:\s*""")
#: The loggers whose handlers get the filter: vLLM's own (every ``vllm.*`` record ends
#: there) and the root logger's (a ``VLLM_LOGGING_CONFIG_PATH`` may route records there).
_LOGGERS = ("vllm", "")
#: The logger that writes request parameters and bodies (``--enable-log-requests``).
_REQUEST_LOGGER = "vllm.entrypoints.serve.utils.request_logger"


def _value_end(text: str, start: int) -> int:
    """Where the value starting at ``text[start]`` ends: a bracketed value at its matching
    bracket (nested brackets and quoted strings inside it skipped), a quoted one at its
    closing quote (escapes skipped), any other at the next ``,`` or ``}`` (or the end of ``text``)."""
    if start >= len(text):
        return start
    first = text[start]
    if first in "'\"":
        index = start + 1
        while index < len(text) and text[index] != first:
            index += 2 if text[index] == "\\" else 1
        return min(index + 1, len(text))
    if first not in "[{(":
        ends = [i for i in (text.find(",", start), text.find("}", start)) if i >= 0]
        return min(ends, default=len(text))
    depth, index = 0, start
    while index < len(text):
        char = text[index]
        if char in "'\"":
            index = _value_end(text, index)
            continue
        if char in "[{(":
            depth += 1
        elif char in "]})":
            depth -= 1
            if depth == 0:
                return index + 1
        index += 1
    return len(text)


def redact(text: str) -> str:
    """``text`` with the value of every ``capabilities`` key replaced by ``REDACTED``."""
    pieces: list[str] = []
    position = 0
    for key in _KEY.finditer(text):
        if key.start() < position:  # inside a value already redacted
            continue
        pieces.append(text[position:key.end()])
        pieces.append(REDACTED)
        position = _value_end(text, key.end())
    pieces.append(text[position:])
    return "".join(pieces)


class CapabilityRedactor(logging.Filter):
    """Rewrites a record whose message names ``capabilities`` to its redacted text (the
    arguments are formatted into the message first); passes every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a record that cannot be formatted is the handler's to report
            return True
        if "capabilities" in message:
            record.msg, record.args = redact(message), None
        return True


_REDACTOR = CapabilityRedactor()


def install() -> None:
    """Add the filter to vLLM's request logger and to the handlers of vLLM's and the root
    logger (the vLLM plugin's entry point; calling it again changes nothing)."""
    logging.getLogger(_REQUEST_LOGGER).addFilter(_REDACTOR)
    for name in _LOGGERS:
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(_REDACTOR)
