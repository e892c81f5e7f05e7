"""overlap_tp_comm's "auto" variant choice (issue 26, defect 3): symmetric memory is chosen, and
enabled for the group, where torch's fused ops can run (CUDA, NCCL, one node, P2P), chunked
elsewhere, with the reason. The process group's layout and the GPU's peer access are stood in
for: the choice is about them, and a CPU has neither NCCL nor P2P."""

import pytest

from graphtrain.passes import overlap_tp_comm as otc


@pytest.fixture
def group(monkeypatch):
    """A stand-in tp group: its layout, peer access, and what got enabled."""
    state = {"backend": "nccl", "ranks": [0, 1], "per_node": 8, "p2p": True, "enabled": set()}
    monkeypatch.setattr(
        otc, "_group_layout", lambda g: (state["backend"], state["ranks"], state["per_node"])
    )
    monkeypatch.setattr(otc, "_peer_access", lambda devices: state["p2p"])
    monkeypatch.setattr(otc, "_symm_mem_enabled", lambda g: g in state["enabled"])
    monkeypatch.setattr(otc, "_enable_symm_mem", lambda g: state["enabled"].add(g))
    return state


def test_auto_chooses_and_enables_symm_mem_on_one_nvlink_node(group):
    use, why = otc.choose_symm_mem("tp0", is_cuda=True)
    # Before the fix "auto" needed the group enabled already, which nothing did: never chosen.
    assert use and "one node" in why
    assert group["enabled"] == {"tp0"}
    assert otc.choose_symm_mem("tp0", is_cuda=True) == (
        True,
        "symmetric memory enabled for the group",
    )


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"backend": "gloo"}, "needs 'nccl'"),
        ({"ranks": [6, 9]}, "span nodes"),  # 8 per node: ranks 6 and 9 on two nodes
        ({"p2p": False}, "no P2P access"),
    ],
)
def test_auto_stays_chunked_where_symm_mem_cannot_run(group, change, reason):
    group.update(change)
    use, why = otc.choose_symm_mem("tp0", is_cuda=True)
    assert not use and reason in why
    assert group["enabled"] == set()
    assert otc.choose_symm_mem("tp0", is_cuda=False) == (False, "not CUDA")


def test_group_layout_of_a_real_gloo_group(monkeypatch):
    """_group_layout on a one-process gloo group (what the stand-in above replaces)."""
    import torch.distributed as dist

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        name = dist.group.WORLD.group_name
        backend, ranks, per_node = otc._group_layout(name)
        assert (backend, ranks, per_node) == ("gloo", [0], 1)
        assert otc.choose_symm_mem(name, is_cuda=True)[0] is False  # gloo: chunked
    finally:
        dist.destroy_process_group()
