"""A deliberately broken copy of Model Runner V2's own slot-mapping kernel (vllm/v1/worker/gpu/block_table.py,
`_compute_slot_mappings_kernel`, vLLM 0.33), monkeypatched into the vllm-mrv2 backend: the vllm#51031 mistake,
the DCP virtual block taken from the kernel block size (`kernel_block_size * cp`) instead of the manager's
(`block_size * cp`). One line differs from vLLM's (marked PLANTED); `validate --deep --backend` must name it at
its step, request and DCP rank."""

from __future__ import annotations

from kvmap.vllm_compat import prepare_cpu
from kvmap.workers.vllm_mrv2 import VllmMRV2Worker

prepare_cpu()  # validate --deep runs backends on host tensors: the interpreter, on before triton is imported

from vllm.triton_utils import tl, triton  # noqa: E402
from vllm.v1.attention.backends.utils import PAD_SLOT_ID  # noqa: E402
from vllm.v1.worker.gpu.buffer_utils import _load_ptr  # noqa: E402


@triton.jit
def _broken_slot_mappings_kernel(
    max_num_tokens, idx_mapping, query_start_loc, pos, block_table_ptrs, block_table_strides, block_sizes,
    slot_mapping_enabled, dcp_sharded, slot_mappings_ptr, slot_mappings_stride, cp_rank,
    CP_SIZE: tl.constexpr, CP_INTERLEAVE: tl.constexpr, PAD_ID: tl.constexpr, TRITON_BLOCK_SIZE: tl.constexpr,
    KERNEL_BLOCK_SIZE: tl.constexpr,
):
    group_id = tl.program_id(0)
    batch_idx = tl.program_id(1)
    slot_mapping_ptr = slot_mappings_ptr + group_id * slot_mappings_stride
    if batch_idx == tl.num_programs(1) - 1:
        actual_num_tokens = tl.load(query_start_loc + batch_idx)
        for i in range(actual_num_tokens, max_num_tokens, TRITON_BLOCK_SIZE):
            offset = i + tl.arange(0, TRITON_BLOCK_SIZE)
            tl.store(slot_mapping_ptr + offset, PAD_ID, mask=offset < max_num_tokens)
        return
    block_table_ptr = _load_ptr(block_table_ptrs + group_id, tl.int32)
    block_table_stride = tl.load(block_table_strides + group_id)
    kv_block_size = tl.load(block_sizes + group_id)
    mapping_enabled = tl.load(slot_mapping_enabled + group_id)
    sharded = tl.load(dcp_sharded + group_id)
    req_state_idx = tl.load(idx_mapping + batch_idx)
    is_real_req = req_state_idx >= 0
    start_idx = tl.load(query_start_loc + batch_idx)
    end_idx = tl.load(query_start_loc + batch_idx + 1)
    for i in range(start_idx, end_idx, TRITON_BLOCK_SIZE):
        offset = i + tl.arange(0, TRITON_BLOCK_SIZE)
        positions = tl.load(pos + offset, mask=offset < end_idx, other=0)
        virtual_block_size = KERNEL_BLOCK_SIZE * CP_SIZE  # PLANTED: vLLM has kv_block_size * CP_SIZE
        virtual_block_indices = positions // virtual_block_size
        virtual_block_offsets = positions % virtual_block_size
        is_local = virtual_block_offsets // CP_INTERLEAVE % CP_SIZE == cp_rank
        rounds = virtual_block_offsets // (CP_INTERLEAVE * CP_SIZE)
        remainder = virtual_block_offsets % CP_INTERLEAVE
        local_offsets = rounds * CP_INTERLEAVE + remainder
        local_positions = virtual_block_indices * kv_block_size + local_offsets
        local_positions = tl.where(sharded, local_positions, positions)
        is_local = ~sharded | is_local
        block_indices = tl.where(mapping_enabled, local_positions // kv_block_size, 0)
        block_offsets = local_positions % kv_block_size
        block_numbers = tl.load(block_table_ptr + req_state_idx * block_table_stride + block_indices,
                                mask=is_local & is_real_req, other=0)
        slot_ids = block_numbers * kv_block_size + block_offsets
        slot_ids = tl.where(is_local, slot_ids, PAD_ID)
        slot_ids = tl.where(mapping_enabled & is_real_req, slot_ids, PAD_ID)
        tl.store(slot_mapping_ptr + offset, slot_ids, mask=offset < end_idx)


class MRV2VirtualBlockFromKernelSize(VllmMRV2Worker):
    """vllm-mrv2 with the broken kernel copy in place of `BlockTables.compute_slot_mappings`'s kernel."""

    name = "vllm-mrv2-51031-bug"

    def __init__(self, header, device: str = "cpu") -> None:
        super().__init__(header, device)
        bt = self.ops.runner.block_tables
        kbs = header.kv_cache_groups[0].kernel_block_size or header.kv_cache_groups[0].block_size

        def compute_slot_mappings(idx_mapping, query_start_loc, positions, num_tokens_padded, out=None):
            s = bt.slot_mappings if out is None else out
            _broken_slot_mappings_kernel[(bt.num_kv_cache_groups, idx_mapping.shape[0] + 1)](
                s.shape[1], idx_mapping, query_start_loc, positions, bt.block_table_ptrs, bt.block_table_strides,
                bt.block_sizes_tensor, bt.slot_mapping_enabled, bt.dcp_sharded, s, s.stride(0), bt.cp_rank,
                CP_SIZE=bt.cp_size, CP_INTERLEAVE=bt.cp_interleave, PAD_ID=PAD_SLOT_ID, TRITON_BLOCK_SIZE=1024,
                KERNEL_BLOCK_SIZE=kbs)
            return s[:, :num_tokens_padded]

        bt.compute_slot_mappings = compute_slot_mappings
