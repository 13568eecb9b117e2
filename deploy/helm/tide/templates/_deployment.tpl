{{/*
The Deployment of one control-plane service (the scaler or the coordinator):
values.replicas (default 1; 1 is Recreate), probed over grpc.health.v1, its settings file from
its ConfigMap, its store from TIDE_DB. Call with (dict "root" $ "component"
"scaler" "values" .Values.scaler "args" (list ...) "apiAccess" true "adminToken" true
"client" true); "client": it dials another service (the scaler → the coordinator) with
the CA and a projected token; "env": more container environment.
*/}}
{{- define "tide.deployment" -}}
{{- $root := .root -}}
{{- $c := .component -}}
{{- $v := .values -}}
{{- $name := printf "%s-%s" (include "tide.fullname" $root) $c -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $name }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "tide.labels" (dict "root" $root "component" $c) | nindent 4 }}
spec:
  {{- $replicas := int ($v.replicas | default 1) }}
  replicas: {{ $replicas }}
  strategy:
    {{- if eq $replicas 1 }}
    # One replica, and an update stops the old pod before the new one starts:
    # two of them side by side would split the agents' streams (scaler) or the
    # trainers' rendezvous (coordinator) between two authorities.
    type: Recreate
    {{- else }}
    # Several elect one leader (a Lease): a rolling update is safe, and the
    # leader's clean stop hands the Lease over at once.
    type: RollingUpdate
    rollingUpdate:
      maxUnavailable: 1
      maxSurge: 0
    {{- end }}
  selector:
    matchLabels:
      {{- include "tide.selectorLabels" (dict "root" $root "component" $c) | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "tide.podLabels" (dict "root" $root "component" $c "values" $v) | nindent 8 }}
      annotations:
        checksum/config: {{ toYaml $v.settings | sha256sum }}
        # Its emptyDir is scratch (SQLite's temporary files), so the cluster
        # autoscaler may evict it to remove a node; the state is in the store.
        cluster-autoscaler.kubernetes.io/safe-to-evict: "true"
        {{- with $v.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      serviceAccountName: {{ $name }}
      # With TLS, both check callers' tokens through the TokenReview API.
      automountServiceAccountToken: {{ or .apiAccess $root.Values.security.tls.enabled }}
      # Service links would put TIDE_*-named variables of this namespace's
      # Services into the environment, where settings are read from.
      enableServiceLinks: false
      terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
      securityContext:
        {{- include "tide.podSecurityContextFor" (dict "root" $root "values" $v) | nindent 8 }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      {{- with $v.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- include "tide.topologySpread" $v | nindent 6 }}
      containers:
        - name: {{ $c }}
          image: {{ include "tide.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          command: ["python", "-m", "tide.services.{{ $c }}"]
          args:
            - --config=/etc/tide/{{ $c }}.yaml
            - --listen=0.0.0.0:{{ $v.grpcPort }}
            - --metrics-listen=0.0.0.0:{{ $v.metricsPort }}
            {{- include "tide.serverSecurityArgs" (dict "root" $root "values" $v) | nindent 12 }}
            {{- if .client }}
            {{- include "tide.clientSecurityArgs" $root | nindent 12 }}
            {{- end }}
            {{- range .args }}
            - {{ . }}
            {{- end }}
          env:
            {{- with .env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
            {{- with $v.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
            {{- include "tide.dbEnv" (dict "root" $root "file" (printf "%s.db" $c)) | nindent 12 }}
            {{- if and .adminToken $root.Values.adminToken.existingSecret }}
            - name: TIDE_ADMIN_TOKEN
              valueFrom:
                secretKeyRef:
                  name: {{ $root.Values.adminToken.existingSecret }}
                  key: {{ $root.Values.adminToken.key }}
            {{- end }}
          ports:
            - name: grpc
              containerPort: {{ $v.grpcPort }}
              protocol: TCP
            - name: metrics
              containerPort: {{ $v.metricsPort }}
              protocol: TCP
            - name: health
              containerPort: {{ $v.healthPort }}
              protocol: TCP
          {{- include "tide.grpcProbes" (dict "port" $v.healthPort) | nindent 10 }}
          resources:
            {{- toYaml $v.resources | nindent 12 }}
          securityContext:
            {{- include "tide.containerSecurityContextFor" (dict "root" $root "values" $v) | nindent 12 }}
          volumeMounts:
            - name: config
              mountPath: /etc/tide
              readOnly: true
            - name: tmp
              mountPath: /tmp
            {{- if eq $root.Values.store.type "sqlite" }}
            - name: data
              mountPath: /var/lib/tide
            {{- end }}
            {{- if $root.Values.security.tls.enabled }}
            - name: tls
              mountPath: /var/run/tide/tls
              readOnly: true
            {{- end }}
            {{- if .client }}
            {{- include "tide.clientSecurityMounts" $root | nindent 12 }}
            {{- end }}
            {{- with $v.extraVolumeMounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
      volumes:
        - name: config
          configMap:
            name: {{ $name }}
        # The root filesystem is read-only; SQLite puts temporary files in /tmp.
        - name: tmp
          emptyDir:
            sizeLimit: 64Mi
        {{- if eq $root.Values.store.type "sqlite" }}
        - name: data
          persistentVolumeClaim:
            claimName: {{ $name }}-data
        {{- end }}
        {{- if $root.Values.security.tls.enabled }}
        # Its certificate from cert-manager (certificates.yaml), renewed in place.
        - name: tls
          secret:
            secretName: {{ $name }}-tls
        {{- end }}
        {{- if .client }}
        {{- include "tide.clientSecurityVolumes" $root | nindent 8 }}
        {{- end }}
        {{- with $v.extraVolumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
{{- end -}}
