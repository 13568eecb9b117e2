# syntax=docker/dockerfile:1
# The trainer base image: the official PaddlePaddle GPU image with the Tide
# launcher as its entrypoint. A training image adds its script on top:
#
#   FROM REGISTRY/tide-trainer:0.1.0
#   COPY train.py /app/train.py
#
# and the PaddleJob's worker container passes `-- python /app/train.py` as its
# args (docs/install.md). Build from the repository root:
#
#   docker build -f deploy/docker/trainer.Dockerfile -t REGISTRY/tide-trainer:0.1.0 .
#
# Blackwell GPUs need the CUDA 12.9 build: --build-arg
# PADDLE_IMAGE=paddlepaddle/paddle:3.3.0-gpu-cuda12.9-cudnn9.9 --build-arg
# PADDLE_INDEX=https://www.paddlepaddle.org.cn/packages/stable/cu129/
ARG PADDLE_IMAGE=paddlepaddle/paddle:3.3.0-gpu-cuda12.6-cudnn9.5
FROM ${PADDLE_IMAGE}

# The official image's own interpreter is Python 3.10 and Tide needs 3.11 or
# newer (pyproject's requires-python). So the launcher and Paddle live in a
# venv of their own, on a CPython installed by uv, with paddlepaddle-gpu of
# the base image's release and CUDA from Paddle's index; the base image still
# supplies the CUDA, cuDNN and NCCL it was built and tested with.
ARG PYTHON_VERSION=3.12
ARG PADDLE_VERSION=3.3.0
ARG PADDLE_INDEX=https://www.paddlepaddle.org.cn/packages/stable/cu126/
ARG UV_VERSION=0.13.9
ENV UV_PYTHON_INSTALL_DIR=/opt/python \
    UV_NO_CACHE=1 \
    PATH=/opt/tide/bin:$PATH \
    PYTHONUNBUFFERED=1
RUN python3 -m pip install --no-cache-dir "uv==${UV_VERSION}" \
    && uv venv --python "${PYTHON_VERSION}" /opt/tide \
    && uv pip install --python /opt/tide/bin/python \
        --index-url "${PADDLE_INDEX}" --extra-index-url https://pypi.org/simple \
        "paddlepaddle-gpu==${PADDLE_VERSION}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY proto/ proto/
COPY tidebase/ tidebase/
COPY trainer/ trainer/
# The launcher and the training library: grpcio, protobuf, numpy, nvidia-ml-py
# (the launcher counts its pod's GPUs) and fsspec (checkpoints in object
# storage; add its backend, e.g. s3fs, in the training image), nothing of the
# control plane.
RUN uv pip install --python /opt/tide/bin/python ".[trainer]" \
    && rm -rf /src

WORKDIR /app
# The launcher reads POD_NAME, POD_IP and POD_NAMESPACE (Downward API),
# TIDE_COORDINATOR and TIDE_JOB from its environment; everything after `--`
# in the container's args is the training command it runs in each generation.
ENTRYPOINT ["python", "-m", "trainer.launch"]
