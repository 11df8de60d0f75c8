"""The Ray provider: workspaces on actors of a local one-node Ray cluster (bound to loopback), the
same calls as the local provider's; a workspace's calls all go to the actor that opened it."""

from __future__ import annotations

import asyncio
import random

import pytest

from rollgym.sandbox import FileAccessError, SandboxError, WorkspaceLimits, make_provider

pytestmark = pytest.mark.slow


def test_workspaces_on_ray_actors(tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'rollgym[ray]'")
    (tmp_path / "main.py").write_text("print('hi')\n")
    ray.init(address="local", include_dashboard=False, num_cpus=2, _node_ip_address="127.0.0.1",
             log_to_driver=False, configure_logging=False)
    provider = make_provider("ray", WorkspaceLimits(timeout_s=10), hosts=2, num_cpus=0.5,
                             uid_base=random.randrange(20000, 39000, 100), uid_count=8)

    async def main() -> None:
        info = await provider.prepare()
        assert info["provider"] == "ray" and len(info["hosts"]) == 2
        a, b = await provider.open(str(tmp_path)), await provider.open(str(tmp_path))
        assert {a.split("-")[0], b.split("-")[0]} == {"0", "1"}  # one on each host
        await provider.write_file(a, "note.txt", "from a\n")
        ran = await provider.exec(a, "python main.py; cat note.txt; ls")
        assert ran.stdout == "hi\nfrom a\nmain.py\nnote.txt\n"
        assert (await provider.exec(b, "ls")).stdout == "main.py\n"
        await provider.snapshot(a)
        await provider.exec(a, "rm note.txt")
        await provider.reset(a, "default")
        assert await provider.read_file(a, "note.txt") == "from a\n"
        with pytest.raises(FileAccessError):
            await provider.read_file(b, "note.txt")
        slow = await provider.exec(b, "sleep 20", timeout_s=1)
        assert slow.killed_reason == "timeout"
        await provider.close(a)
        with pytest.raises(SandboxError, match="no open workspace"):
            await provider.exec(a, "ls")
        await provider.close(b)

    try:
        asyncio.run(main())
    finally:
        provider.shutdown()
        ray.shutdown()
