"""The trace boundary (docs: trace-format.md): records, the checked and fast parsers, the streaming reader.

Rules: nothing outside this package parses trace JSON; every malformed input becomes a located `TraceError`.
"""

from kvmap.trace.checks import Where, loads
from kvmap.trace.fast import fast_step
from kvmap.trace.header import check_fits, parse_header
from kvmap.trace.parse import parse_step
from kvmap.trace.reader import Trace, open_trace
from kvmap.trace.records import (ASYNC_SPEC_KEYS, FORMAT, GROUP_KINDS, PROTOCOLS, TOKEN_ID_LIMIT, AsyncSpecDecode,
                                 CachedRequestData, KVCacheGroup, KVCacheSpec, NewRequestData, SchedulerOutput, Step,
                                 TraceHeader)

__all__ = ["ASYNC_SPEC_KEYS", "FORMAT", "GROUP_KINDS", "PROTOCOLS", "TOKEN_ID_LIMIT", "AsyncSpecDecode",
           "CachedRequestData", "KVCacheGroup", "KVCacheSpec", "NewRequestData", "SchedulerOutput", "Step", "Trace",
           "TraceHeader", "Where", "check_fits", "fast_step", "loads", "open_trace", "parse_header", "parse_step"]
