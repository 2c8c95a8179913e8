package config_test

import (
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/hostd/config"
)

const good = `
log_level = "debug"
log_format = "json"
admin_socket = "/run/shunt/admin.sock"
pairing_timeout = "500ms"

trust_group "tenant" {
  region_size = "16MiB"
  slots       = 64
}

guest "a" {
  id        = 1
  group     = "tenant"
  control   = "/run/shunt/a.sock"
  addresses = ["10.77.1.2"]
}

guest "b" {
  id        = 2
  group     = "tenant"
  control   = "/run/shunt/b.sock"
  addresses = ["10.77.2.2", "fd00::2"]
  ct_mark   = 2
}

policy {
  default   = "fastpath"
  ring_size = "256KiB"
  rule "no-ssh" {
    action = "tcp"
    ports  = ["22"]
  }
}
`

func TestParseGood(t *testing.T) {
	c, err := config.Parse("hostd.hcl", []byte(good))
	if err != nil {
		t.Fatal(err)
	}
	if c.LogLevel != "debug" || c.LogFormat != "json" || c.PairingTimeout != 500*time.Millisecond || c.ReattachGrace != 5*time.Second {
		t.Fatalf("top level: %+v", c)
	}
	if len(c.Groups) != 1 || c.Groups[0].Region != "/dev/shm/shunt-tenant" || c.Groups[0].Geometry.Size != 16<<20 || c.Groups[0].Geometry.Slots != 64 {
		t.Fatalf("groups: %+v", c.Groups)
	}
	if len(c.Guests) != 2 || c.Guests[1].CTMark != 2 || len(c.Guests[1].Addresses) != 2 {
		t.Fatalf("guests: %+v", c.Guests)
	}
	if len(c.Policy.Rules) != 1 || c.Policy.Rules[0].Line != 30 {
		t.Fatalf("policy: %+v", c.Policy)
	}
	if c.Libvirt != nil {
		t.Fatalf("libvirt on without a libvirt block: %+v", c.Libvirt)
	}
}

func TestParseLibvirt(t *testing.T) {
	c, err := config.Parse("hostd.hcl", []byte(good+"libvirt {}\n"))
	if err != nil {
		t.Fatal(err)
	}
	if c.Libvirt == nil || c.Libvirt.Socket != "/run/libvirt/libvirt-sock" || c.Libvirt.URI != "qemu:///system" {
		t.Fatalf("defaults: %+v", c.Libvirt)
	}
	c, err = config.Parse("hostd.hcl", []byte(good+"libvirt {\n  socket = \"/tmp/lv/sock\"\n  uri = \"qemu:///session\"\n}\n"))
	if err != nil {
		t.Fatal(err)
	}
	if c.Libvirt.Socket != "/tmp/lv/sock" || c.Libvirt.URI != "qemu:///session" {
		t.Fatalf("set: %+v", c.Libvirt)
	}
}

func TestParseErrorsNameFileAndLine(t *testing.T) {
	tests := []struct {
		name, src, want string
	}{
		{"typo in attribute", strings.Replace(good, "pairing_timeout", "pairing_timout", 1), `hostd.hcl:5,1: Unsupported argument`},
		{"syntax", good + "\nguest {", "hostd.hcl:"},
		{"unknown group", strings.Replace(good, `group     = "tenant"`, `group     = "tenat"`, 1), `guest "a" (line 12): trust group "tenat" is not defined`},
		{"duplicate id", strings.Replace(good, "id        = 2", "id        = 1", 1), `id 1 is already guest "a"'s`},
		{"bad address", strings.Replace(good, `"10.77.1.2"`, `"10.77.1"`, 1), `address "10.77.1"`},
		{"bad region size", strings.Replace(good, `"16MiB"`, `"16 parsecs"`, 1), `trust_group "tenant" (line 7): region_size`},
		{"bad policy", strings.Replace(good, `ports  = ["22"]`, `ports  = ["ssh"]`, 1), `rule "no-ssh" (line 30): ports: "ssh"`},
		{"bad log level", strings.Replace(good, `"debug"`, `"verbose"`, 1), `log_level "verbose"`},
		{"bad log format", strings.Replace(good, `"json"`, `"yaml"`, 1), `log_format "yaml"`},
		{"bad duration", strings.Replace(good, `"500ms"`, `"soon"`, 1), "pairing_timeout"},
		{"relative libvirt socket", good + "libvirt {\n  socket = \"libvirt-sock\"\n}\n", `libvirt socket "libvirt-sock": want an absolute path`},
		{"libvirt typo", good + "libvirt {\n  sokcet = \"/run/x\"\n}\n", `Unsupported argument`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := config.Parse("hostd.hcl", []byte(tt.src))
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error = %v; want one containing %q", err, tt.want)
			}
		})
	}
}
