from __future__ import annotations

import time

import pytest

from rollgym.sessions import SessionSigner, SessionStore


def test_signed_ids_verify_and_tampering_is_rejected() -> None:
    signer = SessionSigner("a" * 32)
    session_id, cookie = signer.new()
    assert signer.verify(cookie) == session_id
    other_id, _ = signer.new()
    assert other_id != session_id
    forged = f"{other_id}.{cookie.rsplit('.', 1)[1]}"
    assert signer.verify(forged) is None
    assert signer.verify(cookie[:-1] + ("0" if cookie[-1] != "0" else "1")) is None
    assert signer.verify("") is None and signer.verify(None) is None and signer.verify("no-dot") is None
    # Another stack's secret does not accept this stack's cookies.
    assert SessionSigner("b" * 32).verify(cookie) is None


def test_short_secret_is_refused() -> None:
    with pytest.raises(ValueError):
        SessionSigner("short")


def test_store_isolates_sessions_and_expires_idle_ones() -> None:
    store = SessionStore(ttl_s=0.05, sweep_every=1)
    store.get("a")["items"] = [1]
    store.get("b")["items"] = [2]
    assert store.get("a") == {"items": [1]} and store.get("b") == {"items": [2]}
    time.sleep(0.08)
    assert not store.exists("a")
    assert store.get("a") == {}
    assert len(store) == 1  # "b" was swept on access
