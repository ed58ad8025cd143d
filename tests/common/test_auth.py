"""The job's secrets file and record signing (megascale.common.auth)."""
from __future__ import annotations

import json
import stat

import pytest

from megascale.common import auth
from megascale.common.messages import Heartbeat, decode, encode


def heartbeat(**fields) -> Heartbeat:
    return Heartbeat(**{"job": "j", "node": "n0", "host": "h", "ip": "127.0.0.1", "boot_id": "b", "seq": 1,
                        "time": 1.5, "interval_s": 1.0, "phase": "idle", **fields})


def test_secrets_file_is_private_from_its_creation_and_reads_back(tmp_path):
    made = auth.JobSecrets.generate()
    path = tmp_path / "jobs" / "j.secret"
    made.write(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert auth.JobSecrets.read(path) == made
    assert made.redis_password not in repr(made) and made.hmac_key not in repr(made)
    with pytest.raises(auth.SecretsError, match="cannot read the job's secrets file"):
        auth.JobSecrets.read(tmp_path / "missing")


def test_a_signed_record_is_still_one_json_object_that_old_readers_parse():
    signer = auth.JobSecrets.generate().signer()
    record = encode(heartbeat(), signer)
    assert json.loads(record)["mac"] and decode(record) == heartbeat()  # readers ignore fields they do not know
    assert decode(signer.open(record)) == heartbeat()


@pytest.mark.parametrize("tamper, reason", [
    (lambda r: r.replace(b'"seq":1', b'"seq":9'), "bad mac"),  # a changed field
    (lambda r: r[:-9] + b'0123456"}', "bad mac"),  # a changed mac
    (lambda r: encode(heartbeat()), "unsigned"),
    (lambda r: encode(heartbeat(), auth.JobSecrets.generate().signer()), "bad mac"),  # another job's key
    (lambda r: b"\x00" * 200, "unsigned"),
])
def test_tampered_unsigned_or_foreign_records_fail(tamper, reason):
    signer = auth.JobSecrets.generate().signer()
    with pytest.raises(auth.BadRecord) as e:
        signer.open(tamper(encode(heartbeat(), signer)))
    assert e.value.reason == reason


def test_credentials_come_from_the_url_first_then_the_secrets(monkeypatch, tmp_path):
    made = auth.JobSecrets.generate()
    assert made.redis_auth("redis://127.0.0.1:1") == {"username": "megascale", "password": made.redis_password}
    assert made.redis_auth("redis://:given@127.0.0.1:1") == {}
    assert auth.JobSecrets.generate("redis://127.0.0.1:1").redis_auth("redis://127.0.0.1:1") == {}
    own = auth.JobSecrets.generate("redis://u:pw@10.0.0.1:6379/0")  # the job's own Redis: its login moves here
    assert own.redis_auth("redis://10.0.0.1:6379/0") == {"username": "u", "password": "pw"}
    assert auth.split_login("rediss://u:pw@h:1/j?x=1") == ("rediss://h:1/j?x=1", "u", "pw")
    monkeypatch.delenv(auth.SECRETS_ENV, raising=False)
    assert auth.redis_auth("redis://127.0.0.1:1") == {} and auth.env_signer() is None
    made.write(tmp_path / "s")
    monkeypatch.setenv(auth.SECRETS_ENV, str(tmp_path / "s"))
    assert auth.redis_auth("redis://127.0.0.1:1")["password"] == made.redis_password


def test_a_password_in_a_url_is_never_printed():
    assert auth.redacted("redis://u:s3cret@host:6379/0") == "redis://u:***@host:6379/0"
    assert auth.redacted("rediss://:s3cret@host/j?incarnation=2") == "rediss://:***@host/j?incarnation=2"
    assert auth.redacted("redis://host:1") == "redis://host:1"
