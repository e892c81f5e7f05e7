"""A checkpoint from elsewhere runs no code: a planted pickle in trainer-rank0.pt or in DCP's
.metadata is refused, naming the file and the global, on resume and on `graphtrain export`."""

import contextlib
import pickle
import shutil

import pytest
import torch
from conftest import job
from torch.distributed.checkpoint import FileSystemReader

from graphtrain.checkpoint.hf import export_hf
from graphtrain.checkpoint.integrity import (
    file_digest,
    file_entry,
    read_checksums,
    write_checksums,
)
from graphtrain.checkpoint.safe_load import UnsafeCheckpointError, read_dcp_metadata
from graphtrain.config import load_config
from graphtrain.trainer import train


class _RunsCode:
    """Unpickling this calls exec(): it creates the file `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


@pytest.fixture(scope="module")
def saved_run(corpus, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("saved")
    args = job(corpus, tmp, "--training.steps=2", "--checkpoint.interval=2")
    train(load_config(args))
    return tmp / "run", [a for a in args if not a.startswith("--training.run_dir")]


def _plant(saved_run, tmp_path, target):
    """A copy of the run whose checkpoint's `target` file would run code when unpickled."""
    run, args = saved_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    ckpt = copy / "checkpoints" / "step-0000002"
    marker = tmp_path / "code-ran"
    trainer_file, meta_file = ckpt / "trainer-rank0.pt", ckpt / ".metadata"
    state = torch.load(trainer_file, weights_only=True)
    if target == "trainer-rank0.pt":
        torch.save({**state, "extra": _RunsCode(marker)}, trainer_file)
    elif target == "old-format trainer-rank0.pt":  # a plain pickle, not torch's zip format
        trainer_file.write_bytes(pickle.dumps({**state, "extra": _RunsCode(marker)}))
    else:
        meta = ckpt / ".metadata"
        meta.write_bytes(pickle.dumps(_RunsCode(marker)))
        # A forger also rewrites the manifest, so only the unpickler stands in the way.
        state["files"][".metadata"] = {"size": meta.stat().st_size, "sha256": file_digest(meta)}
        torch.save(state, trainer_file)
    # ... and checksums.json (a digest, not a signature).
    write_checksums(ckpt, read_checksums(ckpt) | file_entry(trainer_file) | file_entry(meta_file))
    return copy, ckpt, marker, [*args, f"--training.run_dir={copy}", "--checkpoint.resume=latest"]


@pytest.mark.parametrize("target", ["trainer-rank0.pt", "old-format trainer-rank0.pt", ".metadata"])
def test_a_planted_pickle_is_refused_on_resume_and_export(saved_run, tmp_path, target):
    copy, ckpt, marker, resume = _plant(saved_run, tmp_path, target)
    old_format = target.startswith("old-format")
    target = target.removeprefix("old-format ")
    refused = (
        rf"checkpoint file {ckpt / target} is a pickle the safe loader refuses \(.+\): loading "
        "it any other way could run code"
        if old_format
        else rf"checkpoint file {ckpt / target} refers to (builtins\.)?exec, which is not"
    )
    with pytest.raises(UnsafeCheckpointError, match=refused) as e:
        train(load_config(resume))
    assert "\n" not in str(e.value) and "weights_only" not in str(e.value)
    with pytest.raises(UnsafeCheckpointError, match=refused):
        export_hf(copy, tmp_path / "hf")
    assert not marker.exists()
    # The file is really hostile: torch's own readers run it.
    if target == ".metadata":
        with contextlib.suppress(AttributeError):  # exec() returned None, not a Metadata
            FileSystemReader(str(ckpt)).read_metadata()
    elif old_format:
        pickle.loads((ckpt / target).read_bytes())
    else:
        torch.load(ckpt / target, weights_only=False)
    assert marker.exists()


def test_dcp_metadata_reads_back_through_the_allow_list(saved_run):
    run, _ = saved_run
    ckpt = run / "checkpoints" / "step-0000002"
    ours = read_dcp_metadata(ckpt)
    theirs = FileSystemReader(str(ckpt)).read_metadata()
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data


class _Reduce:
    """Pickles as the call `fn(*args)`, as a pickle from elsewhere may be written."""

    def __init__(self, fn, *args) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def test_getattr_is_read_only_as_an_enum_member(tmp_path):
    # Some Python builds (3.11.2) pickle DCP's enum members as getattr(EnumClass, "NAME"); that
    # form is read, and any other getattr (a path to functions' globals, hence to any code) is
    # refused naming it.
    import io

    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING as Encoding
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from graphtrain.checkpoint.safe_load import _MetadataUnpickler

    def load(obj):
        return _MetadataUnpickler(io.BytesIO(pickle.dumps(obj)), tmp_path / ".metadata").load()

    member = next(iter(Encoding))  # TensorProperties.memory_format is pickled as one
    assert load(_Reduce(getattr, Encoding, member.name)) is member
    for cls, name in ((Encoding, "__init__"), (MetadataIndex, "__init__")):
        with pytest.raises(UnsafeCheckpointError, match="getattr"):
            load(_Reduce(getattr, cls, name))
