# syntax=docker/dockerfile:1
# The control-plane image: the scaler, the coordinator, the node agent and the
# `tide` CLI (`pip install .[services]`), without Paddle. The Helm chart runs
# each service from it with its own command. Build from the repository root:
#
#   docker build -f deploy/docker/services.Dockerfile -t REGISTRY/tide:0.1.0 .
ARG PYTHON_IMAGE=python:3.12-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/tide
WORKDIR /src
# The parts of the package the control plane runs: the API, tide.base and
# tide.services. The trainer, tests, docs and benchmarks stay out of the image.
COPY pyproject.toml README.md constraints.txt ./
COPY tide/__init__.py tide/py.typed tide/
COPY tide/v1/ tide/v1/
COPY tide/base/ tide/base/
COPY tide/services/ tide/services/
RUN /opt/tide/bin/pip install -c constraints.txt ".[services]" \
    && /opt/tide/bin/python -m compileall -q /opt/tide/lib

FROM ${PYTHON_IMAGE}
# The pods run with a read-only root filesystem: nothing may need to write
# bytecode at run time (it was compiled above).
ENV PATH=/opt/tide/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
COPY --from=build /opt/tide /opt/tide
# The chart's pods run as 65532 (runAsNonRoot); so does a plain `docker run`.
USER 65532:65532
WORKDIR /tmp
CMD ["tide", "--help"]
