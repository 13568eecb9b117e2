{{/* Pieces of networkpolicy.yaml's rules. Each renders nothing when it has no peer:
an ingress or egress rule with an empty peer list would admit everyone. */}}

{{- define "tide.metricsIngress" -}}
{{- with .Values.networkPolicy.metricsScrapers }}
# Prometheus scrapes /metrics.
- from:
    {{- toYaml . | nindent 4 }}
  ports:
    - port: metrics
      protocol: TCP
{{- end }}
{{- end -}}

{{- define "tide.apiServerEgress" -}}
{{- $e := .Values.networkPolicy.egress -}}
{{- with $e.apiServerCIDRs }}
# The API server (the scaler's actuator and watches, the agent's node watch).
- to:
    {{- range . }}
    - ipBlock:
        cidr: {{ . }}
    {{- end }}
  ports:
    {{- range $e.apiServerPorts }}
    - port: {{ . }}
      protocol: TCP
    {{- end }}
{{- end }}
{{- end -}}

{{- define "tide.storeEgress" -}}
{{- $e := .Values.networkPolicy.egress -}}
{{- if eq .Values.store.type "postgresql" }}
{{- with $e.store }}
# The PostgreSQL store.
- to:
    {{- toYaml . | nindent 4 }}
  ports:
    - port: {{ $e.storePort }}
      protocol: TCP
{{- end }}
{{- end }}
{{- end -}}
