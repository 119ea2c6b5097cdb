# One image for every pdserve role: `docker run IMAGE gateway|prefill|decode|mixed|demo-model ...`; and the
# gateway's own, without torch (`--target gateway`, entrypoint pdserve-gateway), which compose runs.
# compose.yaml builds and runs them; see README.md, "Docker".

# ---- build: a virtual environment with the pinned dependencies and pdserve --------------------------
FROM python:3.11-slim AS build

# Extra package index searched for torch, e.g. a CPU-only torch index for a much smaller CPU image.
# Empty (the default): the pinned torch from the default index, the CUDA-capable build (several GB; it
# also runs on CPU). Wheels put in docker/wheels/ are offered first either way (offline builds).
ARG TORCH_INDEX_URL=""

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
# gcc builds the CPU kernels (shared/model/kernels/cpu_moe.c, cpu_attention.c) below; the runtime has no compiler.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*

# Dependencies in two cached layers, pins read from pyproject.toml: torch (the big one), then the rest.
# A change to the source reinstalls neither.
COPY pyproject.toml docker/deps.py /tmp/build/
COPY docker/wheels/ /tmp/wheels/
RUN python /tmp/build/deps.py /tmp/build/pyproject.toml torch > /tmp/build/torch.txt \
    && pip install --find-links /tmp/wheels ${TORCH_INDEX_URL:+--extra-index-url=$TORCH_INDEX_URL} \
        -r /tmp/build/torch.txt
RUN python /tmp/build/deps.py /tmp/build/pyproject.toml --not torch > /tmp/build/deps.txt \
    && pip install --find-links /tmp/wheels -r /tmp/build/deps.txt

# pdserve itself, then the container helpers (healthcheck, model-init, secrets-init) next to it.
COPY pyproject.toml README.md /tmp/src/
COPY shared/ /tmp/src/shared/
COPY services/ /tmp/src/services/
COPY docker/healthcheck.py docker/model-init.sh docker/secrets_init.py /tmp/src/docker/
RUN pip install --no-deps /tmp/src \
    && install -m 0755 /tmp/src/docker/healthcheck.py /opt/venv/bin/pdserve-healthcheck \
    && install -m 0755 /tmp/src/docker/model-init.sh /opt/venv/bin/pdserve-model-init \
    && install -m 0755 /tmp/src/docker/secrets_init.py /opt/venv/bin/pdserve-secrets-init
# The CPU kernels, compiled once here into the environment (portable: no -march): the expert kernel's AVX-512
# and AVX2 builds (the widest the CPU runs is used), the attention kernel (without AVX2/FMA: the torch path), the
# norm + RoPE kernel and the same-host KV send's streaming copy (any x86-64).
RUN PDSERVE_KERNEL_CACHE=/opt/venv/share/pdserve/kernels python -c \
        "from shared.model.kernels import cpu_attention, cpu_moe, cpu_norm_rope, cpu_stream_copy; \
print('built', cpu_moe.build(), cpu_attention.build(), cpu_norm_rope.build(), cpu_stream_copy.build())"

# ---- gateway: the REST gateway's own environment, without torch (compose's gateway service builds this target)
# Its dependencies are the ones pyproject.toml lists under [tool.pdserve] gateway-dependencies, pinned as in
# [project] dependencies; pdserve itself goes in with --no-deps. `pdserve-gateway` runs it (not the CLI).
FROM python:3.11-slim AS gateway-build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
COPY pyproject.toml docker/deps.py /tmp/build/
COPY docker/wheels/ /tmp/wheels/
RUN python /tmp/build/deps.py /tmp/build/pyproject.toml --gateway > /tmp/build/gateway.txt \
    && pip install --find-links /tmp/wheels -r /tmp/build/gateway.txt
COPY pyproject.toml README.md /tmp/src/
COPY shared/ /tmp/src/shared/
COPY services/ /tmp/src/services/
COPY docker/healthcheck.py /tmp/src/docker/
RUN pip install --no-deps /tmp/src \
    && install -m 0755 /tmp/src/docker/healthcheck.py /opt/venv/bin/pdserve-healthcheck

FROM python:3.11-slim AS gateway
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PATH=/opt/venv/bin:$PATH
RUN useradd --create-home --uid 1000 --user-group pdserve \
    && mkdir -p /models /run/secrets \
    && chown pdserve:pdserve /models /run/secrets \
    && chmod 0700 /run/secrets
COPY --from=gateway-build /opt/venv /opt/venv
# the gateway starts here without torch, which is not installed
RUN pdserve-gateway --help > /dev/null \
    && python -c "import importlib.util, services.gateway.app; assert importlib.util.find_spec('torch') is None"
USER pdserve
WORKDIR /home/pdserve
EXPOSE 8000
ENTRYPOINT ["pdserve-gateway"]

# ---- runtime: the environment alone (no wheels, no build files), run by an unprivileged user --------
# (the last stage: what a plain `docker build .` makes, every role's image)
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PATH=/opt/venv/bin:$PATH \
    PDSERVE_KERNEL_CACHE=/opt/venv/share/pdserve/kernels

# /models is where checkpoints live, /run/secrets the deployment's secrets (secrets-init writes them): a
# named volume mounted at either starts out owned by pdserve, with these modes.
RUN useradd --create-home --uid 1000 --user-group pdserve \
    && mkdir -p /models /run/secrets \
    && chown pdserve:pdserve /models /run/secrets \
    && chmod 0700 /run/secrets
COPY --from=build /opt/venv /opt/venv
RUN pdserve --help > /dev/null \
    && python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

USER pdserve
WORKDIR /home/pdserve
EXPOSE 8000
ENTRYPOINT ["pdserve"]
CMD ["--help"]
