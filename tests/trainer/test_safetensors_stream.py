"""The streamed shard writer gives save_file's exact bytes for the concatenated tensors, and their checksum."""
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from trainer.data.chunk_digest import file_digest
from trainer.data.safetensors_stream import write_pieces


@pytest.mark.parametrize("features_dtype", [torch.bfloat16, torch.float32])
def test_pieces_are_written_as_save_file_writes_them_whole(tmp_path, features_dtype):
    gen = torch.Generator().manual_seed(0)
    lengths = [7, 1, 0, 12, 3]
    features = [torch.randn(n, 6, generator=gen).to(features_dtype) for n in lengths]
    ids = [torch.randint(0, 1000, (n,), generator=gen, dtype=torch.int32) for n in lengths]
    masks = [torch.rand(n, generator=gen) > 0.5 for n in lengths]
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    whole = {"features": torch.cat(features), "input_ids": torch.cat(ids), "loss_mask": torch.cat(masks),
             "offsets": offsets}
    save_file(whole, str(tmp_path / "whole.safetensors"))

    parts = {"features": features, "input_ids": ids, "loss_mask": masks, "offsets": [offsets]}
    size, digest = write_pieces(str(tmp_path / "pieces.safetensors"), parts, chunk=16)
    data = (tmp_path / "pieces.safetensors").read_bytes()
    assert data == (tmp_path / "whole.safetensors").read_bytes()
    assert (size, digest) == (len(data), file_digest(str(tmp_path / "whole.safetensors")))
    with safe_open(str(tmp_path / "pieces.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("features"), whole["features"])


def test_pieces_that_do_not_fit_together_are_refused(tmp_path):
    with pytest.raises(ValueError, match="share dtype"):
        write_pieces(str(tmp_path / "x"), {"features": [torch.zeros(2, 3), torch.zeros(2, 4)]})
    with pytest.raises(ValueError, match="features: give at least one piece"):
        write_pieces(str(tmp_path / "x"), {"features": [torch.zeros(2, dtype=torch.float16)]})
