{{/* Names, labels and the pieces every Tide pod shares. */}}

{{- define "tide.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release's prefix: the release name alone when it already says "tide". */}}
{{- define "tide.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "tide.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Labels that select one component's pods: call with (dict "root" $ "component" "scaler"). */}}
{{- define "tide.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tide.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Every object's labels: the selector labels plus what tools group by. */}}
{{- define "tide.labels" -}}
{{ include "tide.selectorLabels" . }}
app.kubernetes.io/part-of: tide
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* A component's pod template labels: every object's, plus its podLabels.
Call with (dict "root" $ "component" "scaler" "values" .Values.scaler). */}}
{{- define "tide.podLabels" -}}
{{ include "tide.labels" . }}
{{- with .values.podLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* A component's scheduling and extension points shared by every pod template:
topologySpreadConstraints. Call with the component's values. */}}
{{- define "tide.topologySpread" -}}
{{- with .topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* A ServiceAccount's annotations (serviceAccount.annotations: workload identity,
IRSA), on all three. */}}
{{- define "tide.serviceAccountAnnotations" -}}
{{- with .Values.serviceAccount.annotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Labels that select every pod of this release, whatever its component. */}}
{{- define "tide.releaseSelectorLabels" -}}
app.kubernetes.io/name: {{ include "tide.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The services image: by digest when image.digest is set (immutable), else by tag. */}}
{{- define "tide.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end -}}

{{- define "tide.scalerAddress" -}}
{{ include "tide.fullname" . }}-scaler.{{ .Release.Namespace }}.svc:{{ .Values.scaler.grpcPort }}
{{- end -}}

{{/* Whether agents stream to every scaler replica (--scaler-fanout): leader and
followers all ingest. Not with shards, where a replica ships what it ingests to the
job's owner and a report sent to every replica would count once per replica. */}}
{{- define "tide.scalerFanout" -}}
{{- if and (gt (int .Values.scaler.replicas) 1) (eq (int (.Values.scaler.shards | default 0)) 0) }}true{{ end }}
{{- end -}}

{{- define "tide.scalerPeersAddress" -}}
{{ include "tide.fullname" . }}-scaler-peers.{{ .Release.Namespace }}.svc:{{ .Values.scaler.grpcPort }}
{{- end -}}

{{- define "tide.coordinatorAddress" -}}
{{ include "tide.fullname" . }}-coordinator.{{ .Release.Namespace }}.svc:{{ .Values.coordinator.grpcPort }}
{{- end -}}

{{/* The pod-level security context of every Tide pod: non-root, RuntimeDefault seccomp;
fsGroup makes a fresh PersistentVolume writable by that user. */}}
{{- define "tide.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
fsGroup: 65532
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* A component's pod securityContext: the one above, with the component's
podSecurityContext over it. Call with (dict "root" $ "values" .Values.agent). */}}
{{- define "tide.podSecurityContextFor" -}}
{{- toYaml (mergeOverwrite (fromYaml (include "tide.podSecurityContext" .root)) (deepCopy (.values.podSecurityContext | default dict))) }}
{{- end -}}

{{/* A component's container securityContext: the one below, with its securityContext over it. */}}
{{- define "tide.containerSecurityContextFor" -}}
{{- toYaml (mergeOverwrite (fromYaml (include "tide.containerSecurityContext" .root)) (deepCopy (.values.securityContext | default dict))) }}
{{- end -}}

{{/* The container-level one: no privilege, no capabilities, read-only root filesystem. */}}
{{- define "tide.containerSecurityContext" -}}
runAsNonRoot: true
privileged: false
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{/* TIDE_DB for the scaler, the coordinator and the migration Job: the file on the
service's volume, or the PostgreSQL URL from the Secret. Call with (dict "root" $ "file" "scaler.db"). */}}
{{- define "tide.dbEnv" -}}
- name: TIDE_DB
{{- if eq .root.Values.store.type "postgresql" }}
  valueFrom:
    secretKeyRef:
      name: {{ .root.Values.store.postgresql.existingSecret }}
      key: {{ .root.Values.store.postgresql.urlKey }}
{{- else }}
  value: sqlite:////var/lib/tide/{{ .file }}
{{- end }}
{{- end -}}

{{/* The gRPC health probes of a service listening on .port (the kubelet probes in plaintext). */}}
{{/* Probes on the plaintext health port: the kubelet's gRPC probe has no credentials. */}}
{{- define "tide.grpcProbes" -}}
startupProbe:
  grpc:
    port: {{ .port }}
  # Startup migrates the schema and reloads every job from the store.
  periodSeconds: 2
  failureThreshold: 90
readinessProbe:
  grpc:
    port: {{ .port }}
  periodSeconds: 5
  failureThreshold: 2
livenessProbe:
  # Not the readiness service: a scaler whose database is down is not ready, but
  # restarting it would not bring the database back (tide/services/common/readiness.py).
  grpc:
    port: {{ .port }}
    service: liveness
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 3
{{- end -}}

{{/* Who each reviewed ServiceAccount token is (--token-identities): the release's
agents and scaler, security.trainerServiceAccount in each watched namespace as a
launcher, then security.identities (NAMESPACE/NAME: launcher, viewer,
operator or admin). */}}
{{- define "tide.tokenIdentities" -}}
{{- $ids := list (printf "%s/%s-agent=agent" .Release.Namespace (include "tide.fullname" .)) (printf "%s/%s-scaler=scaler" .Release.Namespace (include "tide.fullname" .)) -}}
{{- with .Values.security.trainerServiceAccount -}}
{{- range $ns := $.Values.scaler.watchNamespaces -}}
{{- $ids = append $ids (printf "%s/%s=launcher" $ns $.Values.security.trainerServiceAccount) -}}
{{- end -}}
{{- end -}}
{{- range $sa, $kind := .Values.security.identities -}}
{{- $ids = append $ids (printf "%s=%s" $sa $kind) -}}
{{- end -}}
{{ join "," $ids }}
{{- end -}}

{{/* A server's security flags (docs/security.md): TLS from its cert-manager
Certificate, callers' projected ServiceAccount tokens checked through TokenReview,
health alone on a plaintext port for the kubelet; or --insecure. */}}
{{- define "tide.serverSecurityArgs" -}}
- --health-listen=0.0.0.0:{{ .values.healthPort }}
{{- if .root.Values.security.tls.enabled }}
- --tls-cert-file=/var/run/tide/tls/tls.crt
- --tls-key-file=/var/run/tide/tls/tls.key
- --token-review
- --token-audience={{ .root.Values.security.tokenAudience }}
- --token-identities={{ include "tide.tokenIdentities" .root }}
{{- else }}
- --insecure
{{- end }}
{{- end -}}

{{/* A client's credentials: the CA that signed the servers and the pod's projected
ServiceAccount token (audience security.tokenAudience), re-read as the kubelet refreshes it. */}}
{{- define "tide.clientSecurityArgs" -}}
{{- if .Values.security.tls.enabled }}
- --tls-ca-file=/var/run/tide/ca/ca.crt
- --token-file=/var/run/tide/token/token
{{- else }}
- --insecure
{{- end }}
{{- end -}}

{{- define "tide.clientSecurityMounts" -}}
{{- if .Values.security.tls.enabled }}
- name: tide-ca
  mountPath: /var/run/tide/ca
  readOnly: true
- name: tide-token
  mountPath: /var/run/tide/token
  readOnly: true
{{- end }}
{{- end -}}

{{/* The CA file alone (not the server's key) from the scaler's certificate Secret, and
a bound token for Tide's audience that expires within the hour. */}}
{{- define "tide.clientSecurityVolumes" -}}
{{- if .Values.security.tls.enabled }}
- name: tide-ca
  secret:
    secretName: {{ include "tide.fullname" . }}-scaler-tls
    items:
      - key: ca.crt
        path: ca.crt
- name: tide-token
  projected:
    sources:
      - serviceAccountToken:
          audience: {{ .Values.security.tokenAudience }}
          expirationSeconds: 3600
          path: token
{{- end }}
{{- end -}}
