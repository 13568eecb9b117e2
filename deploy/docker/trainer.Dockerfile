# syntax=docker/dockerfile:1
# The trainer base image: one Python, one Paddle, the Tide launcher as its
# entrypoint, run as a non-root user. A training image adds its script and its
# requirements on top:
#
#   FROM REGISTRY/tide-trainer:0.1.0
#   COPY requirements.txt train.py /app/
#   RUN pip install -r /app/requirements.txt     # the venv's pip: the Python that runs
#
# and the PaddleJob's worker container passes `-- python /app/train.py` as its
# args (docs/install.md). Build from the repository root:
#
#   docker build -f deploy/docker/trainer.Dockerfile -t REGISTRY/tide-trainer:0.1.0 .
#
# Blackwell GPUs need the CUDA 12.9 build: --build-arg
# PADDLE_INDEX=https://www.paddlepaddle.org.cn/packages/stable/cu129/
ARG PYTHON_IMAGE=python:3.12-slim-bookworm

# Build: a venv (with pip) holding paddlepaddle-gpu, which brings its CUDA, cuDNN
# and NCCL as NVIDIA's pip packages (Paddle 3's wheels), and the launcher, pinned
# by constraints.txt. The GPU driver comes from the node (the NVIDIA container
# toolkit), as for any CUDA image.
FROM ${PYTHON_IMAGE} AS build
ARG PADDLE_VERSION=3.3.0
ARG PADDLE_INDEX=https://www.paddlepaddle.org.cn/packages/stable/cu126/
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY constraints.txt ./
RUN python -m venv /opt/tide \
    && /opt/tide/bin/pip install -c constraints.txt --index-url "${PADDLE_INDEX}" \
        --extra-index-url https://pypi.org/simple "paddlepaddle-gpu==${PADDLE_VERSION}"
COPY pyproject.toml README.md ./
COPY tide/__init__.py tide/py.typed tide/
COPY tide/v1/ tide/v1/
COPY tide/base/ tide/base/
COPY tide/trainer/ tide/trainer/
# The launcher and the training library: grpcio, protobuf, numpy, nvidia-ml-py
# (the launcher counts its pod's GPUs) and fsspec (checkpoints in object
# storage; add its backend, e.g. s3fs, in the training image), nothing of the
# control plane.
# deploy/compat: the launcher's old module path, for one release, warning that
# the launcher moved to tide.trainer.launch (docs/packaging.md).
COPY deploy/compat/ deploy/compat/
RUN /opt/tide/bin/pip install -c constraints.txt ".[trainer]" ./deploy/compat \
    && /opt/tide/bin/python -m compileall -q /opt/tide/lib

# Run: the same Python, the venv copied whole (its pip included), owned by the
# user that runs it, so that a training image's `pip install` lands in it.
FROM ${PYTHON_IMAGE}
ARG UID=1000
ENV PATH=/opt/tide/bin:$PATH \
    PYTHONUNBUFFERED=1
RUN useradd --uid "${UID}" --create-home --shell /usr/sbin/nologin trainer \
    && mkdir /app && chown trainer:trainer /app
COPY --from=build --chown=trainer:trainer /opt/tide /opt/tide
USER trainer
WORKDIR /app
# The launcher reads POD_NAME, POD_IP and POD_NAMESPACE (Downward API),
# TIDE_COORDINATOR and TIDE_JOB from its environment; everything after `--`
# in the container's args is the training command it runs in each generation.
ENTRYPOINT ["python", "-m", "tide.trainer.launch"]
