"""Redis writes: blobs, then one pipelined round of XADDs per batch, with retention applied on the way.

Layout (see :mod:`splitstream.common.records`, which reads it back):

- ``splitstream:calls:<model>``: a stream, one entry per call, id ``*`` (Redis time);
  retention by ``MAXLEN ~`` and/or ``MINID ~`` so trimming stays O(1) amortized
  (whole macro-nodes are dropped; the stream may hold a little more than the limit).
- ``splitstream:blob:<sha256>``: a string with the payload bytes, ``SET NX`` with a TTL
  that every new reference refreshes.
- ``splitstream:feedback:<model>``: a stream, one entry per outcome event, same retention as
  the call streams. An event with an idempotency key is written by a small Lua script that sets
  ``splitstream:feedback-seen:{splitstream:feedback:<model>}:<metric>:<key>`` (NX, TTL ``dedup_ttl_s``) and adds the
  entry only if the key was new: atomic, so a resend after a failure can neither lose the event
  (marked seen, never written) nor write it twice. It rides in the same pipeline as the XADDs.

With ``trim_archived`` (``--trim-archived``), XADD trims nothing; after a batch's entries, one small
script per stream trims it to what retention asks *and* the archive holds: it reads the stream's
archive mark (``splitstream:archived:{<stream>}``, see :func:`splitstream.common.records.archive_mark_key`)
and trims (``MINID ~``) below ``min(retention bound, mark)``. No mark yet (no archiver has run):
nothing is trimmed. An archiver down for long therefore makes Redis grow past its retention, by the
traffic of the outage; each trim the mark held back is counted (``trims_held_by_archive``). A count
retention (MAXLEN) finds its bound with an XRANGE of the excess, at most ``_MAXLEN_CUT_STEP`` entries a
batch, so the catch-up after an outage is spread over batches rather than one long script.

Blob round: ``EXPIRE`` every blob of the batch (refreshes existing ones, and says which
exist), then the missing blobs go out with ``SET NX EX`` in the same pipeline as the
XADDs, ahead of them, so a record is never visible before its blob. Batches without
blobs take one round trip. Pipelines are not transactions: if Redis fails midway, some
records may be written and the router's resend duplicates them (at least once).

Redis Cluster (a :class:`~redis.asyncio.cluster.RedisCluster` client): every command above touches one
slot (the seen key and the archive mark carry their stream's key as a hash tag), but a pipeline is split
per master and the parts are sent concurrently, so "blob ahead of its record" no longer follows from the
order in the pipeline: the missing blobs are written in a round of their own, confirmed, before the XADDs
go out (one more round trip, only for batches with new blobs). Scripts are sent with ``EVAL`` rather
than ``EVALSHA``: a script cache is per node and is not replicated, so a replica promoted in a failover
would answer NOSCRIPT mid-pipeline. A master that fails makes the batch fail (StoreUnavailable; the
router keeps it and resends); the client then re-reads the slot map, so the resend finds the promoted
replica. Commands of the batch that reached the surviving masters stay written: the resend duplicates
them (at least once, as with one Redis).

Redis can be up and still refuse writes (maxmemory under ``noeviction``: OOM; a read-only
replica; MISCONF after a failed save). PING cannot tell: after a write refused with an
error reply, :meth:`check` fails too, so the recorder's health stays NOT_SERVING (and
``redis_writable`` 0) until a batch is written again.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn, cast

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoPermissionError, OutOfMemoryError, ReadOnlyError, RedisError, ResponseError

from splitstream.common.records import LUA_ID_LESS, archive_mark_key, blob_key
from splitstream.common.redis_url import RedisClient, is_cluster
from splitstream.recorder.errors import StoreRefused, StoreUnavailable

#: Error codes (beside redis-py's OutOfMemoryError and ReadOnlyError, whose code it strips from the
#: message) that mean Redis takes no write at all now: failed persistence, too few replicas, no master.
_REFUSAL_CODES = ("MISCONF", "NOREPLICAS", "MASTERDOWN")


def _refuses_every_write(error: ResponseError) -> bool:
    """Redis refuses every write (full under noeviction, a read-only replica, an ACL user without the
    rights, ...): NOT_SERVING until a write succeeds. Any other error reply (WRONGTYPE on one stream key)
    is about the batch, not Redis. NOPERM is a deployment's fault, never a record's: refused as a bad
    batch, the router halved it down to single records and dropped every one."""
    refusals = OutOfMemoryError | ReadOnlyError | NoPermissionError
    return isinstance(error, refusals) or any(code in str(error) for code in _REFUSAL_CODES)


@dataclass(frozen=True, slots=True)
class StreamEntry:
    stream: str
    fields: dict[str, bytes | str]


@dataclass(frozen=True, slots=True)
class FeedbackEntry:
    stream: str
    fields: dict[str, bytes | str]
    #: The key marking its idempotency key seen; None: no idempotency key, always written.
    seen_key: str | None
    model: str


@dataclass(frozen=True, slots=True)
class WriteBatch:
    """What one RecordBatch becomes in Redis: stream entries in order, the distinct blobs they reference,
    and the batch's outcome events."""

    entries: list[StreamEntry]
    blobs: dict[str, bytes]
    feedback: list[FeedbackEntry] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class WriteResult:
    records: int
    #: Blobs that were new (an existing blob only had its TTL refreshed).
    blobs_written: int
    #: Events written, and those skipped as already seen, by model.
    feedback_written: dict[str, int] = field(default_factory=dict)
    feedback_duplicates: dict[str, int] = field(default_factory=dict)
    #: Streams whose retention trim the archive's mark held back (``--trim-archived``).
    trims_held: int = 0


#: KEYS: the seen key, the feedback stream. ARGV: TTL s (0: none), MAXLEN (0: none), MINID ("": none),
#: then the entry's field/value pairs. Returns 1 when written, 0 when the key was seen before.
_ADD_ONCE = """
local set
if ARGV[1] ~= '0' then
  set = redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1])
else
  set = redis.call('SET', KEYS[1], '1', 'NX')
end
if not set then return 0 end
local args = {KEYS[2]}
if ARGV[2] ~= '0' then
  table.insert(args, 'MAXLEN'); table.insert(args, '~'); table.insert(args, ARGV[2])
elseif ARGV[3] ~= '' then
  table.insert(args, 'MINID'); table.insert(args, '~'); table.insert(args, ARGV[3])
end
table.insert(args, '*')
for i = 4, #ARGV do table.insert(args, ARGV[i]) end
redis.call('XADD', unpack(args))
return 1
"""


#: The most entries one archive-aware trim cuts for a count retention (MAXLEN) per batch.
_MAXLEN_CUT_STEP = 10_000

#: KEYS: the stream, its archive mark. ARGV: MINID bound ("": none), MAXLEN (0: none), cut step.
#: Returns {entries trimmed, 1 if retention wanted more than the archive allowed else 0}.
_TRIM_ARCHIVED = (
    LUA_ID_LESS
    + """
local want = nil
if ARGV[1] ~= '' then want = ARGV[1] end
local maxlen = tonumber(ARGV[2])
local excess = 0
if maxlen > 0 then excess = redis.call('XLEN', KEYS[1]) - maxlen end
if want == nil and excess <= 0 then return {0, 0} end
local mark = redis.call('GET', KEYS[2])
local first = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)
if #first == 0 then return {0, 0} end
if want ~= nil and not id_less(first[1][1], want) then want = nil end
if want == nil and excess <= 0 then return {0, 0} end
-- Retention wants to trim. Nothing archived is left in the stream (no mark yet, or the oldest entry
-- is at or past it): held back, without looking for the count's cut (an XRANGE of the excess).
if not mark or not id_less(first[1][1], mark) then return {0, 1} end
if excess > 0 then
  local step = math.min(excess, tonumber(ARGV[3]))
  local page = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', step + 1)
  if #page > step then
    local cut = page[#page][1]
    if want == nil or id_less(want, cut) then want = cut end
  end
end
if want == nil then return {0, 0} end
local held = 0
if id_less(mark, want) then want = mark; held = 1 end
return {redis.call('XTRIM', KEYS[1], 'MINID', '~', want), held}
"""
)


class RedisWriter:
    def __init__(
        self,
        redis: RedisClient,
        *,
        retention_maxlen: int,
        retention_age_s: float,
        blob_ttl_s: int,
        dedup_ttl_s: int | None = None,
        trim_archived: bool = False,
        wait_replicas: int = 0,
        wait_timeout_ms: int = 1000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``dedup_ttl_s``: how long an idempotency key is remembered (None: as long as blobs; 0: for ever).
        ``trim_archived``: retention never trims what the archive does not hold yet (module docstring).
        ``wait_replicas``: a write returns only once that many replicas of every master it wrote to hold it
        (``WAIT`` on the connection that wrote, at the end of each pipeline part), else StoreUnavailable:
        replication is asynchronous, and a master that dies before its replica has a write loses it in the
        failover. ``wait_timeout_ms`` bounds each WAIT (keep it under the socket timeout)."""
        self.redis = redis
        self.cluster = is_cluster(redis)
        self.retention_maxlen = retention_maxlen
        self.retention_age_ms = int(retention_age_s * 1000)
        self.blob_ttl_s = blob_ttl_s
        self.dedup_ttl_s = blob_ttl_s if dedup_ttl_s is None else dedup_ttl_s
        self._add_once = redis.register_script(_ADD_ONCE)
        self.trim_archived = trim_archived
        self.wait_replicas = wait_replicas
        self.wait_timeout_ms = wait_timeout_ms
        self._trim_archived = redis.register_script(_TRIM_ARCHIVED)
        self._clock = clock
        #: Why Redis last refused a write with an error reply; None once a write succeeds again.
        self.refused: str | None = None
        #: Told whether Redis takes writes, whenever a write or probe says (the metrics hook).
        self.on_writable: Callable[[bool], None] = lambda writable: None

    async def ping(self) -> None:
        """Raise :class:`StoreUnavailable` unless Redis answers."""
        try:
            if isinstance(self.redis, RedisCluster):
                await self.redis.ping(target_nodes=RedisCluster.PRIMARIES)
            else:
                await self.redis.ping()
        except (RedisError, OSError, TimeoutError) as error:
            if isinstance(self.redis, RedisCluster):
                # A master is gone: read the slot map again at the next command (a replica promoted since).
                await self.redis.aclose()
            raise StoreUnavailable(f"redis did not answer PING: {_describe(error)}") from error

    async def check(self) -> None:
        """Raise :class:`StoreUnavailable` unless Redis answers and took the last write it was sent.

        No small probe write stands in for a batch: at maxmemory, a 1-byte SET is taken while every
        ~100 KiB batch is refused (the batch's own query buffer tips Redis over), so a probe would make
        health flap. Routers resend refused batches every few seconds; the first one written clears this."""
        await self.ping()
        if self.refused is not None:
            raise StoreUnavailable(f"redis refuses writes: {self.refused}")

    async def write(self, batch: WriteBatch) -> WriteResult:
        """Write ``batch``; returns only after Redis confirmed every command. Raises :class:`StoreUnavailable`."""
        try:
            result = await self._write(batch)
        except ResponseError as error:  # an error reply: Redis is up, but refuses
            if _refuses_every_write(error):
                self._refusing(error)
            raise StoreRefused(f"redis refused this batch: {_describe(error)}") from error
        except (RedisError, OSError, TimeoutError) as error:
            raise StoreUnavailable(f"redis write failed: {_describe(error)}") from error
        self._accepting()
        return result

    def _refusing(self, error: ResponseError) -> NoReturn:
        self.refused = _describe(error)
        self.on_writable(False)
        raise StoreUnavailable(f"redis refuses writes: {self.refused}") from error

    def _accepting(self) -> None:
        self.refused = None
        self.on_writable(True)

    async def _write(self, batch: WriteBatch) -> WriteResult:
        missing = await self._missing_blobs(list(batch.blobs)) if batch.blobs else []
        created = 0
        pipe = self.redis.pipeline(transaction=False)
        for digest in missing:
            pipe.set(blob_key(digest), batch.blobs[digest], nx=True, ex=self.blob_ttl_s or None)
        if self.cluster and missing:
            # Confirmed before any XADD is sent: the pipeline's parts go to their masters concurrently.
            waits = self._queue_waits(pipe, [blob_key(digest) for digest in missing])
            created = sum(1 for result in await self._checked_waits(await pipe.execute(), waits) if result)
            pipe = self.redis.pipeline(transaction=False)
        blob_commands = len(pipe)
        minid = self._age_bound()
        maxlen = self.retention_maxlen or None
        archive_bounds = (minid, maxlen)
        if self.trim_archived:
            minid = maxlen = None  # trimmed below, stream by stream, no further than the archive
        for entry in batch.entries:
            # XADD takes one trim strategy; with both configured the count rides on XADD and the
            # age is applied once per stream below.
            pipe.xadd(
                entry.stream,
                cast(dict[Any, Any], entry.fields),
                maxlen=maxlen,
                minid=None if maxlen else minid,
                approximate=True,
            )
        for event in batch.feedback:
            if event.seen_key is None:
                pipe.xadd(
                    event.stream,
                    cast(dict[Any, Any], event.fields),
                    maxlen=maxlen,
                    minid=None if maxlen else minid,
                    approximate=True,
                )
            else:
                pairs = [part for item in event.fields.items() for part in item]
                args = [self.dedup_ttl_s, maxlen or 0, "" if maxlen or not minid else minid, *pairs]
                await self._script(self._add_once, pipe, keys=[event.seen_key, event.stream], args=args)
        streams = list(dict.fromkeys([entry.stream for entry in batch.entries] + [e.stream for e in batch.feedback]))
        if maxlen and minid:
            for stream in streams:
                pipe.xtrim(stream, minid=minid, approximate=True)
        trimmed_from = len(pipe)
        if self.trim_archived and any(archive_bounds):
            for stream in streams:
                args = [archive_bounds[0] or "", archive_bounds[1] or 0, _MAXLEN_CUT_STEP]
                await self._script(self._trim_archived, pipe, keys=[stream, archive_mark_key(stream)], args=args)
        # Every key of this pipeline is in one of these streams' slots (blobs went ahead on a cluster).
        waits = self._queue_waits(pipe, [*streams, *(blob_key(digest) for digest in missing if not self.cluster)])
        results = await self._checked_waits(await pipe.execute(), waits)
        trims_held = sum(int(result[1]) for result in results[trimmed_from:])
        created += sum(1 for result in results[:blob_commands] if result)
        start = blob_commands + len(batch.entries)
        written: Counter[str] = Counter()
        duplicates: Counter[str] = Counter()
        for event, result in zip(batch.feedback, results[start : start + len(batch.feedback)], strict=True):
            # XADD answers the entry's id; the script 1 (written) or 0 (seen before).
            if event.seen_key is not None and result == 0:
                duplicates[event.model] += 1
            else:
                written[event.model] += 1
        return WriteResult(
            records=len(batch.entries),
            blobs_written=created,
            feedback_written=dict(written),
            feedback_duplicates=dict(duplicates),
            trims_held=trims_held,
        )

    def _age_bound(self) -> str | None:
        """The stream id below which the age retention trims, or None (no age retention, or one reaching back
        before 1970, which keeps everything): a negative bound is no stream id, Redis refused every batch
        with "Invalid stream ID", and routers, halving the refused batches, dropped every record."""
        bound = int(self._clock() * 1000) - self.retention_age_ms
        return str(bound) if self.retention_age_ms and bound > 0 else None

    def _queue_waits(self, pipe: Any, keys: list[str]) -> list[int]:
        """Queue a WAIT behind the writes on each master ``keys`` live on (one on one Redis); the replica count
        each must reach.

        On a cluster that is ``wait_replicas`` or the replicas the slot map gives that master, the fewer: a
        replica promoted in a failover has none until its old master comes back (or another is added), and
        waiting for one would stop recording for good; it then has what one Redis has, the master's copy."""
        if not self.wait_replicas or not keys:
            return []
        if not isinstance(self.redis, RedisCluster):
            pipe.execute_command("WAIT", self.wait_replicas, self.wait_timeout_ms)
            return [self.wait_replicas]
        slots = self.redis.nodes_manager.slots_cache
        nodes: dict[str, tuple[Any, int]] = {}
        for key in keys:
            serving = slots.get(self.redis.keyslot(key)) or []
            if serving:
                nodes[serving[0].name] = (serving[0], min(self.wait_replicas, len(serving) - 1))
        needs = [(node, needed) for node, needed in nodes.values() if needed]  # WAIT 0 would block its timeout
        for node, needed in needs:
            pipe.execute_command("WAIT", needed, self.wait_timeout_ms, target_nodes=node)
        return [needed for _, needed in needs]

    async def _checked_waits(self, results: list[Any], waits: list[int]) -> list[Any]:
        """``results`` without the trailing WAIT replies; StoreUnavailable when one counted too few replicas."""
        if not waits:
            return results
        short = [
            (int(count), needed)
            for count, needed in zip(results[-len(waits) :], waits, strict=True)
            if int(count) < needed
        ]
        if short:
            if isinstance(self.redis, RedisCluster):
                await self.redis.aclose()  # a replica gone: the slot map says so once read again
            count, needed = short[0]
            raise StoreUnavailable(
                f"written, but only {count} of {needed} replicas confirmed within "
                f"{self.wait_timeout_ms} ms (the batch is not acknowledged; a resend may duplicate it)"
            )
        return results[: -len(waits)]

    async def _script(self, script: Any, pipe: Any, *, keys: list[str], args: list[Any]) -> None:
        """Queue ``script`` on ``pipe``: EVALSHA (loaded first by the pipeline) on one Redis, EVAL on a cluster
        (module docstring: a promoted replica has an empty script cache)."""
        if self.cluster:
            pipe.eval(script.script, len(keys), *keys, *args)
        else:
            await script(keys=keys, args=args, client=pipe)

    async def _missing_blobs(self, digests: list[str]) -> list[str]:
        """Refresh the TTL of the blobs that exist; return the digests of those that do not."""
        pipe = self.redis.pipeline(transaction=False)
        for digest in digests:
            if self.blob_ttl_s:
                pipe.expire(blob_key(digest), self.blob_ttl_s)
            else:
                pipe.exists(blob_key(digest))
        found = await pipe.execute()
        return [digest for digest, hit in zip(digests, found, strict=True) if not hit]


def _describe(error: BaseException) -> str:
    text = str(error)
    # redis-py prefixes a pipeline's error with the failed command and its first arguments (a
    # record's request id, model, ...): client data that has no place in logs or in the status
    # routers get. Redis's own reply says what is wrong.
    command, sep, reply = text.partition(" of pipeline caused error: ")
    if sep and command.startswith("Command # "):
        text = f"{command.split(' (', 1)[0]} of pipeline: {reply}"
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
