#!/usr/bin/env bash
# Build engines for your own model (a target and a smaller draft with the same tokenizer),
# look at what the build measured, and generate.
#
#   examples/own_model.sh TARGET DRAFT OUT [extra `specrt build` flags]
#   examples/own_model.sh path/to/Qwen3-1.7B path/to/Qwen3-0.6B artifacts/qwen3 --max-context 2048 --k 4
#   PRECISION=int4 examples/own_model.sh path/to/hf_dir int8 artifacts/mine-int4
#
# TARGET: a Hugging Face folder (config.json + *.safetensors), a .gguf file, or a model id already
#         in the local Hugging Face cache (specrt never downloads).
# DRAFT:  a path to a smaller model with the same tokenizer, or int8 (the target's own int8
#         copy), truncate:N (its first N layers), none (plain decoding; prompt lookup still works).
# Environment: PRECISION=fp32|int8|int4 (default fp32), PROMPT, SPECRT (the command to run,
# default `specrt`; e.g. SPECRT="python -m specrt.cli").
set -euo pipefail

if [[ $# -lt 3 || $1 == -h || $1 == --help ]]; then
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"   # the comment above
    [[ $# -ge 1 && ($1 == -h || $1 == --help) ]] && exit 0 || exit 2
fi
TARGET=$1 DRAFT=$2 OUT=$3
shift 3
read -r -a SPECRT_CMD <<< "${SPECRT:-specrt}"

# export, check parity against transformers, quantize if asked, measure, write OUT/manifest.json
"${SPECRT_CMD[@]}" build --target "$TARGET" --draft "$DRAFT" --out "$OUT" --precision "${PRECISION:-fp32}" --quiet "$@"
# what the build recorded: shapes, parity, the draft's agreement, the speculation plan
"${SPECRT_CMD[@]}" inspect "$OUT"
# greedy: token for token what plain decoding of the target gives
"${SPECRT_CMD[@]}" generate "$OUT" "${PROMPT:-Tell me about the sea.}" --max-new-tokens 32
