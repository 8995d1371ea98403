"""capture_format: the one definition of capture records, wire frames, codecs and shard files.

Shared by the SGLang plugin (encodes frames), the collector (inspects frames, writes shards) and
the trainer (reads shards). It imports only the standard library, numpy, zstandard and xxhash,
never torch, fastapi, sglang or pydantic: a test checks this. The format is documented by example
in README.md next to this file.
"""

from capture_format.bfloat16 import bfloat16_bits_from_float32, float32_from_bfloat16_bits
from capture_format.codecs import AVAILABLE_CODECS, Codec, ErrorSums, TensorLayout, get_codec
from capture_format.errors import (
    CaptureFormatError,
    ChecksumError,
    CodecError,
    FrameError,
    InvalidRecordError,
    ShardError,
    UnknownCodecError,
)
from capture_format.frame_header import FrameInfo, TensorInfo
from capture_format.layers import (
    LayerConfigError,
    capture_layers_from_sglang_ids,
    capture_layers_to_sglang_ids,
    default_capture_layers,
    validate_capture_layers,
)
from capture_format.frames import (
    DEFAULT_CODECS,
    FRAME_FORMAT_VERSION,
    FRAME_MAGIC,
    FRAME_PREFIX_NBYTES,
    MAX_FRAME_NBYTES,
    FramePrefix,
    codec_for_states,
    decode_frame,
    encode_frame,
    frame_errors,
    inspect_frame,
    parse_frame_prefix,
    read_frame_prefix,
    verify_inspected_frame,
)
from capture_format.records import (
    AUX_SEMANTICS,
    FINAL_SEMANTICS,
    INPUT_EMBEDS_SEMANTICS,
    SCHEMA_VERSION,
    SCHEMA_VERSIONS,
    STATE_DTYPES,
    TOKEN_ID_DTYPE,
    CaptureRecord,
    StatesPrefix,
    mask_from_spans,
    num_span_positions,
    spans_from_mask,
)
from capture_format.prefix_blocks import DanglingPrefixError, block_record_id, is_prefix_block, prefix_key
from capture_format.record_windows import RecordLayout, RecordWindow
from capture_format.shard_index import INDEX_FORMAT_VERSION, IndexEntry, ShardIndex, load_index
from capture_format.object_store import RecordCache, is_remote
from capture_format.shard_directories import open_shard_directory
from capture_format.shard_reader import DamagedShard, ShardDirectory, VerifyReport, verify_shard
from capture_format.shards import RecoveryReport, ShardWriter, recover_open_shard, repair_shard, write_shards

__all__ = [
    "AUX_SEMANTICS",
    "AVAILABLE_CODECS",
    "DEFAULT_CODECS",
    "FINAL_SEMANTICS",
    "FRAME_FORMAT_VERSION",
    "FRAME_MAGIC",
    "FRAME_PREFIX_NBYTES",
    "INDEX_FORMAT_VERSION",
    "INPUT_EMBEDS_SEMANTICS",
    "MAX_FRAME_NBYTES",
    "SCHEMA_VERSION",
    "SCHEMA_VERSIONS",
    "STATE_DTYPES",
    "TOKEN_ID_DTYPE",
    "CaptureFormatError",
    "CaptureRecord",
    "ChecksumError",
    "DanglingPrefixError",
    "Codec",
    "CodecError",
    "FrameError",
    "FrameInfo",
    "FramePrefix",
    "IndexEntry",
    "InvalidRecordError",
    "LayerConfigError",
    "RecordCache",
    "RecordLayout",
    "RecordWindow",
    "RecoveryReport",
    "DamagedShard",
    "ErrorSums",
    "ShardDirectory",
    "ShardError",
    "ShardIndex",
    "ShardWriter",
    "StatesPrefix",
    "TensorInfo",
    "TensorLayout",
    "UnknownCodecError",
    "VerifyReport",
    "bfloat16_bits_from_float32",
    "block_record_id",
    "is_prefix_block",
    "prefix_key",
    "capture_layers_from_sglang_ids",
    "capture_layers_to_sglang_ids",
    "default_capture_layers",
    "validate_capture_layers",
    "decode_frame",
    "encode_frame",
    "frame_errors",
    "float32_from_bfloat16_bits",
    "codec_for_states",
    "get_codec",
    "inspect_frame",
    "is_remote",
    "load_index",
    "open_shard_directory",
    "parse_frame_prefix",
    "read_frame_prefix",
    "recover_open_shard",
    "repair_shard",
    "mask_from_spans",
    "num_span_positions",
    "spans_from_mask",
    "verify_inspected_frame",
    "verify_shard",
    "write_shards",
]
