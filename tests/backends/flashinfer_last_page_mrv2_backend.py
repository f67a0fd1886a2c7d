"""A deliberately broken copy of vLLM's FlashInfer page-table rule (vllm/v1/attention/backends/flashinfer.py,
`FlashInferMetadataBuilder._compute_flashinfer_kv_metadata`, vLLM 0.33), put into the vllm-mrv2 backend's FlashInfer
builder: a row whose KV fills its last page exactly gets `paged_kv_last_page_len = page_size - 1` (vLLM:
`page_size`). One line differs from vLLM's (marked PLANTED); `validate --deep --backend` must name it at its step,
request, group and field."""

from __future__ import annotations

import numpy as np

from kvmap.vllm_compat import prepare_cpu
from kvmap.workers.vllm_mrv2 import VllmMRV2Worker

prepare_cpu()  # validate --deep runs backends on host tensors: the interpreter, on before triton is imported

import vllm.v1.attention.backends.flashinfer as fi  # noqa: E402


class LastPageOneShort(fi.FlashInferMetadataBuilder):
    def _compute_flashinfer_kv_metadata(self, num_blocks_np, seq_lens_np, block_table_tensor, num_reqs, page_size):
        np.cumsum(num_blocks_np, dtype=np.int32, out=self.paged_kv_indptr.np[1: num_reqs + 1])
        paged_kv_indptr = self.paged_kv_indptr.copy_to_gpu(num_reqs + 1)
        num_actual_pages = self.paged_kv_indptr.np[num_reqs]
        paged_kv_indices = self.paged_kv_indices[:num_actual_pages]
        fi._copy_page_indices_kernel[(num_reqs,)](paged_kv_indices, block_table_tensor, block_table_tensor.stride(0),
                                                  paged_kv_indptr, BLOCK_SIZE=1024)
        paged_kv_last_page_len_np = seq_lens_np % page_size
        self.paged_kv_last_page_len.np[:num_reqs] = np.where(
            (paged_kv_last_page_len_np == 0) & (seq_lens_np != 0),
            page_size - 1,  # PLANTED: vLLM has page_size
            paged_kv_last_page_len_np)
        self.paged_kv_last_page_len.copy_to_gpu(num_reqs)
        return paged_kv_indices


class MRV2FlashInferLastPageOneShort(VllmMRV2Worker):
    """vllm-mrv2 whose FlashInfer builder is the broken copy."""

    name = "vllm-mrv2-last-page-bug"

    def use_forward(self, config) -> None:
        super().use_forward(config)
        self.vllm_parts.flashinfer_class = LastPageOneShort
