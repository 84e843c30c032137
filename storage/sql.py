"""The run store on SQLAlchemy 2: SQLite by default (a file), PostgreSQL by URL."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import delete, inspect, select
from sqlalchemy.exc import (
    ArgumentError,
    DatabaseError,
    IntegrityError,
    InternalError,
    NoSuchModuleError,
    OperationalError,
    ProgrammingError,
)
from sqlalchemy.orm import Session, sessionmaker

from storage import pending
from storage.base import RunStore, plan_version, validate_result
from storage.checkpoints import CheckpointFiles, encode
from storage.engine import create_store_engine, database_failure, opening_error, shown_url
from storage.errors import NotAStoreError, NotFoundError, StateError, StoreError
from storage.integrity import integrity_problems
from storage.lease import SqlLeases, fence_in
from storage.location import choose_root, default_root, unknown_root_error
from storage.outage import ServerWait, rides_outages
from storage.records import (
    CheckpointRef,
    DeviceRecord,
    DeviceResult,
    Event,
    MetricPoint,
    ResumeState,
    RoundRecord,
    RunRecord,
    Tensors,
    utcnow,
)
from storage.rows import device_record, round_record, run_record, utc
from storage.schema import (
    CheckpointRow,
    DeviceResultRow,
    DeviceRow,
    EventRow,
    MetricRow,
    RoundRow,
    RunProfileRow,
    RunRow,
    StoreSettingRow,
)

__all__ = ["SqlRunStore", "create_store_engine"]


_ROOT_KEY = "checkpoint_root"
_AGE = 3600.0  # files younger than this may belong to a commit under way in another process


@rides_outages
class SqlRunStore(SqlLeases, RunStore):
    """Rows in SQL, checkpoint tensors in content-addressed safetensors files."""

    def __init__(
        self,
        url: str,
        checkpoint_dir: str | Path | None = None,
        migrate: bool = True,
        password: str | None = None,
        readonly: bool = False,
        outage_wait: float = 0.0,  # s a transaction waits for its server (storage.outage)
    ) -> None:
        self.url = url  # as given: no password that was given apart
        self.readonly = readonly
        try:
            self.engine = create_store_engine(url, password, readonly)
            sqlite = self.engine.dialect.name == "sqlite"  # no server to wait for
            self._server = ServerWait(shown_url(url), 0.0 if sqlite else outage_wait, self.engine)
            self._server.opening(lambda: self._check_schema(migrate))
        except (ArgumentError, NoSuchModuleError, DatabaseError, ValueError) as error:
            raise opening_error(url, error) from None
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._files: CheckpointFiles | None = None
        explicit = None if checkpoint_dir is None else Path(checkpoint_dir).absolute()
        root = self._checkpoint_root(explicit)
        if root is not None:
            self._files = CheckpointFiles(root, readonly)
        # what crashed or full-disk commits left (none at once that may be another's)
        self.collected_on_open = 0 if readonly or root is None else self.collect_garbage(_AGE)

    def _check_schema(self, migrate: bool) -> None:
        """Migrate a writable store (only when behind: an open at head writes nothing); a
        read-only one must be at a revision this edgesplit can read."""
        from storage.migrate import READABLE, current_revision, ensure_current, head, not_a_store

        with self.engine.connect() as connection:
            revision = current_revision(connection)
            refused = None if revision else not_a_store(connection, self.readonly)
        if refused is not None:
            raise NotAStoreError(f"--db {shown_url(self.url)}: not an edgesplit store ({refused})")
        if not self.readonly:
            if migrate:
                ensure_current(self.engine)
            return
        if revision not in READABLE:
            raise StoreError(
                f"the database at {shown_url(self.url)} is at schema revision {revision}, "
                f"this edgesplit reads {head()}: upgrade it (`edgesplit db upgrade`) or use "
                "the edgesplit that wrote it"
            )

    def _checkpoint_root(self, explicit: Path | None) -> Path | None:
        """The checkpoint folder (see :mod:`storage.location`), recorded when first given."""
        stored = self._setting(_ROOT_KEY)
        recorded = None if stored is None else Path(stored)
        chosen = choose_root(
            explicit,
            recorded,
            default_root(self.url),
            recorded is not None and recorded.is_dir(),
            self.readonly,
        )
        if chosen.record and chosen.path is not None:
            try:
                with self._session() as session:
                    session.merge(StoreSettingRow(key=_ROOT_KEY, value=str(chosen.path)))
            except IntegrityError:  # another open recorded one at the same moment
                if self._setting(_ROOT_KEY) != str(chosen.path):
                    message = f"--checkpoints {chosen.path}: another was just recorded"
                    raise StoreError(message) from None
        return chosen.path

    def _setting(self, key: str) -> str | None:
        with self._session() as session:
            if not inspect(session.connection()).has_table(StoreSettingRow.__tablename__):
                return None  # a read-only open of a revision before store_settings
            row = session.get(StoreSettingRow, key)
            return None if row is None else row.value

    @property
    def files(self) -> CheckpointFiles:
        """The checkpoint files; a server database that never recorded its folder has none
        until told with ``--checkpoints``."""
        if self._files is None:
            raise unknown_root_error(shown_url(self.url))
        return self._files

    @contextmanager
    def _session(self, fence: str | None = None) -> Iterator[Session]:
        """A transaction; ``fence``: a run whose lease must still be this store's holder's
        (:meth:`fence`), renewed in the transaction, else :class:`LeaseLostError`."""
        try:
            with self._server.session(self._sessions) as session:
                if fence is not None and (holder := self.fenced(fence)) is not None:
                    fence_in(session, fence, holder)
                yield session
        except (OperationalError, ProgrammingError, InternalError) as error:
            raise database_failure(self.url, error) from None

    def check_can_commit(self) -> None:
        if self.readonly:
            raise StoreError(f"the store at {shown_url(self.url)} was opened read-only")
        self.files  # noqa: B018 - raises when the checkpoint folder is unknown

    def close(self) -> None:
        self.engine.dispose()

    def stop_waiting(self) -> None:
        self._server.stop()

    def outages(self) -> list[float]:
        return self._server.take_ended()

    # ---------------------------------------------------------------- devices
    def _upsert_device(self, device: DeviceRecord) -> None:
        with self._session() as session:
            row = session.scalar(select(DeviceRow).where(DeviceRow.name == device.name))
            if row is None:
                row = DeviceRow(name=device.name)
                session.add(row)
            row.kind, row.memory_bytes, row.flops = device.kind, device.memory_bytes, device.flops
            row.uplink_bytes, row.credentials_ref = device.uplink_bytes, device.credentials_ref
            row.status, row.last_seen = device.status, device.last_seen

    def _device_row(self, session: Session, name: str) -> DeviceRow:
        row = session.scalar(select(DeviceRow).where(DeviceRow.name == name))
        if row is None:
            raise NotFoundError(f"no device named {name!r}")
        return row

    def get_device(self, name: str) -> DeviceRecord:
        with self._session() as session:
            return device_record(self._device_row(session, name))

    def list_devices(self) -> list[DeviceRecord]:
        with self._session() as session:
            rows = session.scalars(select(DeviceRow).order_by(DeviceRow.name))
            return [device_record(r) for r in rows]

    # ---------------------------------------------------------------- runs
    def _create_run(self, run_id: str, config: dict[str, Any], seed: int) -> RunRecord:
        now = utcnow()
        try:
            with self._session() as session:
                row = RunRow(id=run_id, config=config, status="created", seed=seed)
                row.created_at, row.updated_at, row.plan, row.plan_version = now, now, None, 0
                session.add(row)
                session.flush()
                return run_record(row)
        except IntegrityError as error:
            raise StateError(f"run {run_id!r} exists already") from error

    def _run_row(self, session: Session, run_id: str) -> RunRow:
        row = session.get(RunRow, run_id)
        if row is None:
            raise NotFoundError(f"no run {run_id!r}")
        return row

    def get_run(self, run_id: str) -> RunRecord:
        with self._session() as session:
            return run_record(self._run_row(session, run_id))

    def list_runs(self) -> list[RunRecord]:
        with self._session() as session:
            rows = session.scalars(select(RunRow).order_by(RunRow.created_at))
            return [run_record(r) for r in rows]

    def _set_run_status(self, run_id: str, status: str) -> None:
        with self._session(run_id) as session:
            row = self._run_row(session, run_id)
            row.status, row.updated_at = status, utcnow()

    def set_run_config(self, run_id: str, config: Mapping[str, Any]) -> None:
        with self._session(run_id) as session:
            row = self._run_row(session, run_id)
            row.config, row.updated_at = dict(config), utcnow()

    def set_plan(self, run_id: str, plan: Mapping[str, Any], *, revise: bool = False) -> int:
        with self._session(run_id) as session:
            row = self._run_row(session, run_id)
            version = plan_version(run_id, row.plan_version, revise)
            row.plan, row.plan_version, row.updated_at = dict(plan), version, utcnow()
            return row.plan_version

    # ---------------------------------------------------------------- rounds
    def _round_row(self, session: Session, run_id: str, number: int) -> RoundRow:
        row = session.scalar(
            select(RoundRow).where(RoundRow.run_id == run_id, RoundRow.number == number)
        )
        if row is None:
            raise NotFoundError(f"no round {number} in run {run_id!r}")
        return row

    def _uncommitted(self, session: Session, run_id: str, number: int) -> RoundRow:
        row = self._round_row(session, run_id, number)
        if row.state == "committed":
            raise StateError(f"round {number} of run {run_id!r} is committed already")
        return row

    def open_round(self, run_id: str, number: int, participants: Sequence[str]) -> RoundRecord:
        with self._session(run_id) as session:
            self._run_row(session, run_id)
            row = session.scalar(
                select(RoundRow).where(RoundRow.run_id == run_id, RoundRow.number == number)
            )
            if row is not None and row.state == "committed":
                raise StateError(f"round {number} of run {run_id!r} is committed already")
            if row is None:
                row = RoundRow(run_id=run_id, number=number)
                session.add(row)
            row.state, row.participants, row.opened_at = "open", list(participants), utcnow()
            row.metrics, row.evaluation, row.committed_at = {}, {}, None
            row.results.clear()
            session.flush()
            return round_record(row)

    def record_result(self, run_id: str, number: int, result: DeviceResult) -> None:
        self.record_results(run_id, number, [result])

    def record_results(self, run_id: str, number: int, results: Sequence[DeviceResult]) -> None:
        for result in results:
            validate_result(result)
        with self._session(run_id) as session:
            row = self._uncommitted(session, run_id, number)
            replaced = {r.device for r in results}
            for existing in list(row.results):
                if existing.device in replaced:
                    row.results.remove(existing)
            session.flush()
            latest = {r.device: r for r in results}  # the last result of a device wins
            row.results.extend(
                DeviceResultRow(
                    device=r.device,
                    examples=r.examples,
                    loss=r.loss,
                    accuracy=r.accuracy,
                    bytes_sent=r.bytes_sent,
                    bytes_received=r.bytes_received,
                    wall_seconds=r.wall_seconds,
                    peak_memory_bytes=r.peak_memory_bytes,
                    failure=r.failure,
                )
                for r in latest.values()
            )

    def _set_round_state(self, run_id: str, number: int, state: str) -> None:
        with self._session(run_id) as session:
            self._uncommitted(session, run_id, number).state = state

    def commit_round(
        self,
        run_id: str,
        number: int,
        weights: Mapping[str, Tensors],
        optimizer_states: Mapping[str, Tensors] | None = None,
        metrics: Mapping[str, float] | None = None,
        evaluation: Mapping[str, float] | None = None,
    ) -> RoundRecord:
        if not weights:
            raise ValueError("commit_round: weights must name at least one segment")
        # 1. Files first, each recorded as pending, then fsynced and renamed into place:
        # durable before any row names them, and a killed commit's files known to its run.
        kinds = [("weights", weights), ("optimizer", optimizer_states or {})]
        encoded = [(s, k, *encode(t)) for k, group in kinds for s, t in group.items()]
        with self._session(run_id) as session:
            pending.mark(session, run_id, (digest for *_, digest, _ in encoded))
        refs = []
        for segment, kind, digest, payload in encoded:
            self.files.write(digest, payload)
            refs.append(CheckpointRef(segment, kind, digest, len(payload)))
        # 2. One transaction makes the round committed and current, or nothing happens.
        with self._session(run_id) as session:
            row = self._uncommitted(session, run_id, number)
            for ref in refs:
                row.checkpoints.append(
                    CheckpointRow(
                        segment=ref.segment,
                        kind=ref.kind,
                        sha256=ref.sha256,
                        size_bytes=ref.size_bytes,
                    )
                )
            pending.settle(session, run_id, (ref.sha256 for ref in refs))
            row.state, row.committed_at = "committed", utcnow()
            row.metrics = {k: float(v) for k, v in (metrics or {}).items()}
            row.evaluation = {k: float(v) for k, v in (evaluation or {}).items()}
            run = self._run_row(session, run_id)
            if run.current_round is None or number > run.current_round:
                run.current_round = number
            run.updated_at = utcnow()
            session.flush()
            return round_record(row)

    def get_round(self, run_id: str, number: int) -> RoundRecord:
        with self._session() as session:
            return round_record(self._round_row(session, run_id, number))

    def list_rounds(self, run_id: str) -> list[RoundRecord]:
        with self._session() as session:
            self._run_row(session, run_id)
            rows = session.scalars(
                select(RoundRow).where(RoundRow.run_id == run_id).order_by(RoundRow.number)
            )
            return [round_record(r) for r in rows]

    def checkpoint(self, run_id: str, number: int) -> ResumeState:
        with self._session() as session:
            run_row = self._run_row(session, run_id)
            row = self._round_row(session, run_id, number)
            if row.state != "committed":
                raise StateError(f"round {number} of run {run_id!r} is not committed")
            refs = tuple(
                CheckpointRef(c.segment, c.kind, c.sha256, c.size_bytes) for c in row.checkpoints
            )
            record, run = round_record(row), run_record(run_row)
        weights: dict[str, dict[str, Any]] = {}
        states: dict[str, dict[str, Any]] = {}
        for ref in refs:
            target = weights if ref.kind == "weights" else states
            target[ref.segment] = self.files.get(ref.sha256, ref.size_bytes)
        return ResumeState(run, record, weights, states, refs)

    # ---------------------------------------------------------------- metrics and events
    def add_metrics(self, run_id: str, points: Iterable[MetricPoint]) -> None:
        with self._session(run_id) as session:
            self._run_row(session, run_id)
            session.add_all(
                MetricRow(
                    run_id=run_id,
                    round=p.round,
                    device=p.device,
                    name=p.name,
                    value=float(p.value),
                    recorded_at=p.recorded_at or utcnow(),
                )
                for p in points
            )

    def metrics(self, run_id: str, name: str | None = None) -> list[MetricPoint]:
        query = select(MetricRow).where(MetricRow.run_id == run_id)
        if name is not None:
            query = query.where(MetricRow.name == name)
        with self._session() as session:
            return [
                MetricPoint(r.name, r.value, r.round, r.device, utc(r.recorded_at))
                for r in session.scalars(query.order_by(MetricRow.id))
            ]

    def add_event(self, run_id: str | None, event: Event) -> None:
        self.add_events(run_id, [event])

    def add_events(self, run_id: str | None, events: Sequence[Event]) -> None:
        with self._session(run_id) as session:
            if run_id is not None:
                self._run_row(session, run_id)
            session.add_all(
                EventRow(
                    run_id=run_id,
                    kind=event.kind,
                    detail=event.detail,
                    device=event.device,
                    round=event.round,
                    at=event.at or utcnow(),
                )
                for event in events
            )

    def events(self, run_id: str | None = None) -> list[Event]:
        query = select(EventRow)
        if run_id is not None:
            query = query.where(EventRow.run_id == run_id)
        with self._session() as session:
            return [
                Event(r.kind, r.detail, r.device, r.round, utc(r.at))
                for r in session.scalars(query.order_by(EventRow.id))
            ]

    # ---------------------------------------------------------------- maintenance
    def integrity_problems(self, deep: bool = False) -> list[str]:
        with self._session() as session:
            return integrity_problems(session, self.files, deep)

    def round_problem(self, run_id: str, number: int, deep: bool = True) -> str | None:
        if self._files is None:
            return "the checkpoint folder is unknown (give --checkpoints)"
        with self._session() as session:
            row = self._round_row(session, run_id, number)
            if row.state != "committed":
                return f"round {number} is not committed"
            refs = [(c.sha256, c.size_bytes) for c in row.checkpoints]
        problems = (self._files.check(sha, size, deep) for sha, size in refs)
        return next((p for p in problems if p), None)

    def _rewind(self, run_id: str, number: int | None, event: Event) -> None:
        with self._session() as session:
            run = self._run_row(session, run_id)
            later = session.scalars(
                select(RoundRow).where(RoundRow.run_id == run_id, RoundRow.number > (number or 0))
            )
            for row in later:
                row.state, row.committed_at = "open", None
                row.checkpoints.clear()
                row.results.clear()
            session.execute(
                delete(MetricRow).where(MetricRow.run_id == run_id, MetricRow.round > (number or 0))
            )
            run.current_round, run.updated_at = number, utcnow()
            session.add(EventRow(run_id=run_id, kind=event.kind, detail=event.detail, at=utcnow()))

    def collect_garbage(self, older_than_seconds: float = 3600.0) -> int:
        if self.readonly:
            return 0
        with self._session() as session:  # holding the files lock: no commit marks meanwhile
            kept = pending.protected(session, older_than_seconds)
            return self.files.collect_garbage(kept, older_than_seconds)

    def discard_pending(self, run_id: str) -> int:
        if self.readonly or self._files is None:
            return 0
        with self._session(run_id) as session:
            return pending.discard(session, self._files, run_id)

    # ---------------------------------------------------------------- profiles
    def set_profile(self, run_id: str, document: Mapping[str, Any]) -> None:
        with self._session(run_id) as session:
            self._run_row(session, run_id)
            row = RunProfileRow(run_id=run_id, document=dict(document), recorded_at=utcnow())
            session.merge(row)

    def get_profile(self, run_id: str) -> dict[str, Any] | None:
        with self._session() as session:
            if not inspect(session.connection()).has_table(RunProfileRow.__tablename__):
                return None  # a read-only open of a revision before run_profiles
            row = session.get(RunProfileRow, run_id)
            return None if row is None else dict(row.document)
