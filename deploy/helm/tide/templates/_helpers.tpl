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
{{- end -}}

{{/* Labels that select every pod of this release, whatever its component. */}}
{{- define "tide.releaseSelectorLabels" -}}
app.kubernetes.io/name: {{ include "tide.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tide.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "tide.scalerAddress" -}}
{{ include "tide.fullname" . }}-scaler.{{ .Release.Namespace }}.svc:{{ .Values.scaler.grpcPort }}
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
  # restarting it would not bring the database back (services/common/readiness.py).
  grpc:
    port: {{ .port }}
    service: liveness
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 3
{{- end -}}
