# syntax=docker/dockerfile:1
#
# bitserve on a CUDA host.
#
#   docker build -t bitserve .
#   docker run --gpus all -p 8000:8000 -v "$PWD/models:/models:ro" bitserve   # workers over all GPUs
#   docker run --gpus device=0 -p 8000:8000 bitserve serve        # the built-in demo model
#
# The base image brings CUDA, cuDNN, torch and the Triton that torch was built with; the
# package is installed on top of it WITHOUT reinstalling torch (a second torch would add
# gigabytes and could mismatch the image's CUDA libraries).
#
# BASE_IMAGE must track the torch pin of the dev/test set-up (Makefile: TORCH_PIN=torch==2.13.0):
# when the pin moves, move this tag with it (tests/deploy/test_dockerfile.py checks they agree).
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda12.8-cudnn9-runtime

# --- build: a virtual environment on top of the image's Python ------------------------------
FROM ${BASE_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore
# --system-site-packages: the venv sees the image's torch, triton and numpy, so pip treats
# `torch>=...` as satisfied; the constraints file turns any attempt to replace them into an
# error instead of a silent multi-GB download.
RUN python -m venv --system-site-packages /opt/bitserve \
 && python -c "import importlib.metadata as md; print('\n'.join(sorted({f'{d.name}=={d.version}' for d in md.distributions() if d.name.lower() in ('torch', 'triton', 'numpy')})))" > /tmp/image-constraints.txt \
 && cat /tmp/image-constraints.txt
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gpu_ops ./gpu_ops
COPY service ./service
RUN /opt/bitserve/bin/pip install --constraint /tmp/image-constraints.txt ".[server,tracing]" \
 && /opt/bitserve/bin/python -c "import torch, service, gpu_ops; print('torch', torch.__version__)"

# --- runtime: the same base, the venv, a non-root user ----------------------------------------
FROM ${BASE_IMAGE} AS runtime
ARG UID=10001
RUN groupadd --system --gid ${UID} bitserve \
 && useradd --system --uid ${UID} --gid bitserve --home-dir /home/bitserve --create-home \
        --shell /usr/sbin/nologin bitserve \
 && mkdir -p /models && chown bitserve:bitserve /models
COPY --from=build /opt/bitserve /opt/bitserve
# Triton compiles kernels at first use: its cache goes to the user's (writable) home.
ENV PATH=/opt/bitserve/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    BITSERVE_HOST=0.0.0.0 \
    BITSERVE_PORT=8000 \
    TRITON_CACHE_DIR=/home/bitserve/.triton/cache
USER bitserve
WORKDIR /home/bitserve
VOLUME ["/models"]
EXPOSE 8000
# Ready = every model is loaded and warm; start-period covers loading onto the device.
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/v2/health/ready' % os.environ.get('BITSERVE_PORT', '8000'), timeout=2)"]
# Exec form: bitserve is PID 1 and receives SIGTERM itself; with several workers (the default
# with a GPU or on more than two cores) it is their supervisor and passes the SIGTERM on, and every worker
# drains its in-flight requests (give it time: docker stop -t / compose stop_grace_period /
# k8s terminationGracePeriodSeconds). The workers' run directory is in /tmp.
ENTRYPOINT ["bitserve"]
CMD ["serve", "--model-repository", "/models"]
