package dist

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/shuntnet/shunt/hostd/metrics"
)

func TestExprMetrics(t *testing.T) {
	for _, tc := range []struct {
		expr string
		want []string
	}{
		{`shunt_flows`, []string{"shunt_flows"}},
		{`sum by (state, mode) (shunt_flows{instance=~"$instance",state="ready"})`, []string{"shunt_flows"}},
		{`histogram_quantile(0.99, sum by (le) (rate(shunt_flow_setup_seconds_bucket{job="x"}[$__rate_interval])))`, []string{"shunt_flow_setup_seconds_bucket"}},
		{`sum(rate(a_sum[5m])) / sum(rate(a_count[5m])) > 1e-3`, []string{"a_sum", "a_count"}},
		{`topk(10, sum by (flow) (b)) and on (flow) c unless ignoring(x) d offset 5m`, []string{"b", "c", "d"}},
		{`sum(x) without (guest) > bool 0`, []string{"x"}},
	} {
		t.Run(tc.expr, func(t *testing.T) {
			if got := ExprMetrics(tc.expr); !slices.Equal(got, tc.want) {
				t.Errorf("ExprMetrics(%q) = %q, want %q", tc.expr, got, tc.want)
			}
		})
	}
}

// TestDashboard: the dashboard is valid JSON of the shape Grafana imports,
// its panels have unique ids and every query names a metric.
func TestDashboard(t *testing.T) {
	var d struct {
		UID    string `json:"uid"`
		Panels []struct {
			ID         int             `json:"id"`
			Type       string          `json:"type"`
			Title      string          `json:"title"`
			Datasource json.RawMessage `json:"datasource"`
			Targets    []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(Dashboard, &d); err != nil {
		t.Fatal(err)
	}
	if d.UID == "" || len(d.Panels) == 0 {
		t.Fatalf("dashboard: uid %q, %d panels; want a uid and panels", d.UID, len(d.Panels))
	}
	ids := map[int]string{}
	for _, p := range d.Panels {
		if prev, ok := ids[p.ID]; ok {
			t.Errorf("panels %q and %q share id %d", prev, p.Title, p.ID)
		}
		ids[p.ID] = p.Title
		if p.Type == "row" {
			continue
		}
		if !strings.Contains(string(p.Datasource), "${datasource}") {
			t.Errorf("panel %q: datasource %s, want the ${datasource} variable", p.Title, p.Datasource)
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no queries", p.Title)
		}
		for _, q := range p.Targets {
			if len(ExprMetrics(q.Expr)) == 0 {
				t.Errorf("panel %q: query %q selects no metric", p.Title, q.Expr)
			}
		}
	}
}

// TestDashboardMetricsExist serves hostd's metrics as hostd does
// (metrics.New, promhttp over its registry), with every labelled metric
// touched once, and checks that each metric the dashboard queries is in
// the scrape. A renamed or removed metric fails here. The packaging test
// checks the same against the installed hostd.
func TestDashboardMetricsExist(t *testing.T) {
	m := metrics.New()
	m.Switches.WithLabelValues("tcp", "admin").Inc()
	m.Opens.WithLabelValues("active").Inc()
	m.Flows.WithLabelValues("ready", "direct").Inc()
	m.Setup.Observe(300e-6)
	m.Sessions.WithLabelValues("vm1").Inc()
	m.NewFlowBytes(func() []metrics.FlowStat {
		return []metrics.FlowStat{{Flow: "tenant-a/0.1", GuestA: "vm1", GuestB: "vm2", BytesAB: 4, BytesBA: 4}}
	})
	srv := httptest.NewServer(promhttp.HandlerFor(m.Registry, promhttp.HandlerOpts{}))
	defer srv.Close()
	resp, err := http.Get(srv.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	scraped, err := SampleNames(resp.Body)
	if err != nil {
		t.Fatal(err)
	}

	want, err := DashboardMetrics(Dashboard)
	if err != nil {
		t.Fatal(err)
	}
	if len(want) < 5 {
		t.Fatalf("dashboard queries %d metrics (%q); want hostd's", len(want), want)
	}
	t.Logf("the dashboard queries %q", want)
	for _, name := range want {
		if !scraped[name] {
			t.Errorf("the dashboard queries %s, which hostd does not export", name)
		}
	}
}
