# sfq-proxy container image.
#
#   docker build -t sfq-proxy:0.1.0 .
#   docker run --rm -p 8080:8080 -v "$PWD/config.yaml:/etc/sfq-proxy/config.yaml:ro" \
#     -e ANALYTICS_KEY=... sfq-proxy:0.1.0
#
# The config must listen on 0.0.0.0 (the default 127.0.0.1 is unreachable from outside the
# container) and on port 8080, which EXPOSE and HEALTHCHECK below assume.
#
# tests/deploy/test_deploy_files.py runs the RUN lines marked `# test: build` and `# test: install`
# outside Docker, in a fresh virtual environment, and starts the result: keep every path
# those lines use in the variables it sets (VIRTUAL_ENV, WHEELS).
#
# The runtime dependencies come from requirements.lock: every version pinned, every file's
# hash checked (`make lock` refreshes it within pyproject.toml's bounds). Logs are JSON
# (SFQ_LOG_FORMAT below), with or without `docker run -t`; -e SFQ_LOG_FORMAT=text to read
# them by eye.

# One base for both stages: the venv built in the final stage uses its interpreter. For
# byte-for-byte reproducible builds, pin the digest too: python:3.12-slim@sha256:...
ARG PYTHON_IMAGE=python:3.12-slim

# -- build: a wheel of the project, and the lock of its dependencies beside it --------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    WHEELS=/wheels
WORKDIR /src
# exactly what the wheel is made of; .dockerignore keeps everything else out of the context
COPY pyproject.toml README.md LICENSE requirements.lock ./
COPY sfq_proxy ./sfq_proxy
# The image carries the proxy alone: the scenario lab and the simulated server stay out
# (their commands then say how to get them).
# test: build
RUN rm -rf sfq_proxy/lab sfq_proxy/sim \
    && pip wheel --no-cache-dir --no-deps --wheel-dir "${WHEELS}" . \
    && cp requirements.lock "${WHEELS}/"

# -- final: the locked dependencies and the package in a venv, run as a non-root user -------
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="sfq-proxy" \
      org.opencontainers.image.description="Fair-share (Start-time Fair Queueing) reverse proxy for OpenAI-compatible LLM servers" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="docker.io/library/python:3.12-slim"
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PYTHONUNBUFFERED=1 \
    SFQ_LOG_FORMAT=json \
    VIRTUAL_ENV=/opt/sfq-proxy \
    WHEELS=/tmp/wheels
ENV PATH="${VIRTUAL_ENV}/bin:${PATH}"
COPY --from=build /wheels /tmp/wheels
# the lock's exact files (--require-hashes), then the wheel alone (--no-deps); pip check
# fails the build when the lock lacks a dependency the wheel declares
# test: install
RUN python -m venv "${VIRTUAL_ENV}" \
    && "${VIRTUAL_ENV}/bin/pip" install --no-cache-dir --require-hashes -r "${WHEELS}/requirements.lock" \
    && "${VIRTUAL_ENV}/bin/pip" install --no-cache-dir --no-deps "${WHEELS}"/sfq_proxy-*.whl \
    && "${VIRTUAL_ENV}/bin/pip" check \
    && rm -rf "${WHEELS}"
# uid/gid 10001, numeric below so Kubernetes' runAsNonRoot can verify it; the calibration
# state (calibration.state_file) goes under /var/lib/sfq-proxy
RUN groupadd --system --gid 10001 sfq \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /var/lib/sfq-proxy \
       --shell /usr/sbin/nologin sfq \
    && mkdir -p /etc/sfq-proxy /var/lib/sfq-proxy \
    && chown 10001:10001 /var/lib/sfq-proxy
USER 10001:10001
WORKDIR /var/lib/sfq-proxy

EXPOSE 8080
# /healthz answers 200 while the process serves; urllib because slim has no curl
HEALTHCHECK --interval=15s --timeout=5s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=4)"]
# SIGTERM makes the proxy stop accepting, drain in-flight requests for drain_timeout_s, exit 0:
# give `docker stop` a longer --time (default 10 s) than that
STOPSIGNAL SIGTERM
ENTRYPOINT ["sfq-proxy", "serve", "--config", "/etc/sfq-proxy/config.yaml"]
