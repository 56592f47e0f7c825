"""``splitstream-archive``'s command line as a user meets it, on real archiver and redis-server processes: which
models it archives, which archive a consumer group belongs to."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from splitstream.common.records import entry_fields, stream_key
from tests.harness import run_module, wait_for
from tests.redis_server import RedisServer
from tests.test_archive import archived_everything, running_archiver, start_archiver, synthetic_record


def add_calls(client: object, model: str, count: int) -> None:
    for i in range(count):
        record = synthetic_record(i, time.time_ns())
        record.model = model
        client.xadd(stream_key(model), entry_fields(record))  # type: ignore[attr-defined]


@pytest.mark.slow
def test_a_model_whose_name_holds_a_comma_can_be_archived_alone(tmp_path: Path, redis_server: RedisServer) -> None:
    """``--model a,b`` was split into models ``a`` and ``b``, though a model may be named ``a,b``: that model could
    not be archived alone (nor at all with --model). Each --model is one name; repeat it for several."""
    client = redis_server.client()
    add_calls(client, "a,b", 5)
    add_calls(client, "a", 5)
    add_calls(client, "c", 5)
    with running_archiver(tmp_path, redis_server.url, "--model", "a,b", "--model", "c"):
        wait_for(
            lambda: archived_everything(client, stream_key("a,b")) and archived_everything(client, stream_key("c")),
            timeout_s=60,
            what="models a,b and c to be archived",
        )
        assert not archived_everything(client, stream_key("a"))
        assert not (tmp_path / "archive" / "calls" / "model=a").exists()


def test_an_empty_model_is_refused_with_exit_2_not_taken_for_every_model(tmp_path: Path) -> None:
    """``--model "$UNSET"`` left no model to filter on, and an archiver meant for one model archived every one."""
    result = run_module("splitstream.archiver", "--port", "0", "--metrics-port", "0", "--model", "")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == ["splitstream-archive: error: --model: model is empty"], result.stderr


@pytest.mark.slow
def test_a_second_archive_on_a_consumer_group_is_refused_with_exit_2_and_the_first_misses_nothing(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Two archivers sharing a group but writing to different archives split the entries between them: each
    archive missed what the group handed the other's archiver. The second archive is refused; the same archive
    spelled another way (a path, not a file URL) joins the group."""
    client = redis_server.client()
    add_calls(client, "m", 50)
    first_dir = tmp_path / "archive"
    with running_archiver(tmp_path, redis_server.url, consumer="a"):
        other = tmp_path / "other-archive"
        second = start_archiver(tmp_path, redis_server.url, str(other), consumer="b", wait=False)
        assert second.wait(timeout_s=60) == 2, second.log()
        assert second.log().strip().splitlines()[-1] == (
            f"splitstream-archive: error: --group splitstream-archive: its archivers write to local:{first_dir}, "
            f"this one to local:{other}: each archive needs its own --group (or delete the key "
            "splitstream:archive-group:splitstream-archive in Redis to move the group to this archive)"
        )
        assert not any(other.rglob("*.parquet"))
        same = start_archiver(tmp_path, redis_server.url, str(first_dir), consumer="c")
        add_calls(client, "m", 50)
        wait_for(lambda: archived_everything(client, stream_key("m")), timeout_s=60, what="every call archived")
        same.stop()


@pytest.mark.slow
def test_an_archiver_whose_acl_predates_the_group_check_warns_and_archives_as_before(tmp_path: Path) -> None:
    """docs/security.md's archiver ACL before the group check had no ``~splitstream:archive-group:*``: NOPERM on
    that key stopped the archiver at its upgrade, archiving nothing while retention trimmed on."""
    from tests.test_tls import ARCHIVER_ACL

    older_acl = ARCHIVER_ACL.replace(" ~splitstream:archive-group:*", "")
    assert older_acl != ARCHIVER_ACL, "docs/security.md's archiver ACL names the group key"
    with RedisServer(tmp_path / "redis", password="admin-pw", users=[older_acl]) as server:
        client = server.client()
        add_calls(client, "m", 20)
        with running_archiver(tmp_path, server.url_for("splitstream-archiver", "archiver-pw")) as archiver:
            wait_for(lambda: archived_everything(client, stream_key("m")), timeout_s=60, what="m to be archived")
            assert "cannot check which archive this consumer group writes to" in archiver.log()
