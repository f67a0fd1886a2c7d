"""The trace boundary (docs/trace-format.md): records, two step decoders and their rules, the streaming reader.

Rules: nothing outside this package parses trace JSON; every malformed input becomes a located `TraceError`;
a step line is decoded only through `Trace.decode` (or `parse_step`, the checked parser, by tools that read
lines leniently), so every consumer gets the same `Step`.
"""

from kvmap.trace.checks import Where, loads
from kvmap.trace.invariants import check_step
from kvmap.trace.header import check_fits, parse_header
from kvmap.trace.parse import parse_step
from kvmap.trace.reader import Trace, open_trace
from kvmap.trace.records import (ASYNC_SPEC_KEYS, FORMAT, GROUP_KINDS, PROTOCOLS, TOKEN_ID_LIMIT, AsyncSpecDecode,
                                 CachedRequestData, KVCacheGroup, KVCacheSpec, NewRequestData, SchedulerOutput, Step,
                                 TraceHeader)

__all__ = ["ASYNC_SPEC_KEYS", "FORMAT", "GROUP_KINDS", "PROTOCOLS", "TOKEN_ID_LIMIT", "AsyncSpecDecode",
           "CachedRequestData", "KVCacheGroup", "KVCacheSpec", "NewRequestData", "SchedulerOutput", "Step", "Trace",
           "TraceHeader", "Where", "check_fits", "check_step", "loads", "open_trace", "parse_header", "parse_step"]
