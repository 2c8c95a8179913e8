package agent

import (
	"context"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/shuntnet/shunt/hostd/metrics"
)

// TestMetricsUnixSocket: metrics_address = "unix:PATH" serves /metrics on
// a Unix socket of mode 0600 (replacing a stale socket), and refuses to
// replace anything that is not a socket.
func TestMetricsUnixSocket(t *testing.T) {
	path := filepath.Join(t.TempDir(), "run", "metrics.sock")
	for range 2 { // the second time over the first one's socket file
		l, err := listenMetrics("unix:" + path)
		if err != nil {
			t.Fatal(err)
		}
		st, err := os.Stat(path)
		if err != nil || st.Mode()&os.ModeSocket == 0 || st.Mode().Perm() != 0o600 {
			t.Fatalf("metrics socket %v, %v; want a socket of mode 0600", st.Mode(), err)
		}
		m := metrics.New()
		srv := &http.Server{Handler: promhttp.HandlerFor(m.Registry, promhttp.HandlerOpts{}), ReadHeaderTimeout: 5 * time.Second}
		go srv.Serve(l)
		c := http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{
			DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
				return (&net.Dialer{}).DialContext(ctx, "unix", path)
			},
		}}
		resp, err := c.Get("http://hostd/metrics")
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if !strings.Contains(string(body), "shunt_control_limited_total") {
			t.Fatalf("/metrics over the socket:\n%s", body)
		}
		srv.Close()
		// Leave a stale socket behind, as a killed hostd does.
		if ul, ok := l.(*net.UnixListener); ok {
			ul.SetUnlinkOnClose(false)
		}
		l.Close()
	}
	os.Remove(path)
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := listenMetrics("unix:" + path); err == nil || !strings.Contains(err.Error(), "not a socket") {
		t.Fatalf("over a regular file: %v, want an error saying it is not a socket", err)
	}
}
