// Command hostd is Shunt's host daemon and its CLI.
//
//	hostd agent -config /etc/shunt/hostd.hcl   run the daemon
//	hostd check -config /etc/shunt/hostd.hcl   check the config and the host before starting it
//	hostd guests | flows | status | counters  show state (tables; -json for JSON)
//	hostd peers                                the peer hosts' hostds (docs/crosshost.md)
//	hostd reload                               re-read the policy and the peer blocks (as SIGHUP does)
//	hostd downgrade CONN                       move one connection to TCP (alias: revoke)
//	hostd guest add|remove|list                guests at run time (containers)
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"sort"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/shuntnet/shunt/hostd/admin"
	"github.com/shuntnet/shunt/hostd/agent"
	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/config"
	"github.com/shuntnet/shunt/hostd/peers"
	"github.com/shuntnet/shunt/hostd/preflight"
)

const usage = `usage: hostd <command> [flags]

commands:
  agent  -config FILE     run the daemon
  check  -config FILE     check the config and this host; exit 1 on a problem (-json)
  guests                  list guests (configured and libvirt) and their sessions
  flows                   list connections: path (rings, leaving, tcp), reason, switches, bytes
  status                  summary
  counters                fallback, switch and flow counters
  peers                   the peer hosts' hostds: state, link, prefixes, bytes (docs/crosshost.md)
  reload                  re-read the policy and the peer blocks; moves connections between
                          the rings and TCP
  downgrade CONN          move one connection to TCP until the next reload (name as in
                          'hostd flows')
  revoke CONN             the old name of downgrade
  migrate-out GUEST       move a VM's connections to TCP and keep them there, until
                          none holds rings (hostd unplugs its pair regions itself): then
                          unplug its group region's ivshmem device and migrate it
  migrate-in GUEST        let its connections take the rings again; with -control SOCKET,
                          -interface TAP and -qmp SOCKET, serve its new control socket,
                          mark its new tap and plug its pair regions into the new QEMU
                          (the destination's)

  guest add|remove|list   add and remove process and container guests at run time
                          (hostd guest help; docs/containers.md)
  cdi    -config FILE     print the CDI spec that puts containers on container_socket

client flags: -admin SOCKET (default /run/shunt/admin.sock), -json
`

func main() {
	if len(os.Args) < 2 {
		fmt.Fprint(os.Stderr, usage)
		os.Exit(2)
	}
	cmd, args := os.Args[1], os.Args[2:]
	var err error
	switch cmd {
	case "agent":
		err = runAgent(args)
	case "check":
		os.Exit(runCheck(args))
	case "guest":
		err = runGuest(args)
	case "cdi":
		err = runCDI(args)
	case admin.CmdGuests, admin.CmdFlows, admin.CmdStatus, admin.CmdCounters, admin.CmdReload, admin.CmdRevoke, admin.CmdDowngrade,
		admin.CmdMigrateOut, admin.CmdMigrateIn, admin.CmdPeers:
		err = runClient(cmd, args)
	case "-h", "-help", "--help", "help":
		fmt.Print(usage)
	default:
		fmt.Fprintf(os.Stderr, "hostd: unknown command %q\n\n%s", cmd, usage)
		os.Exit(2)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "hostd %s: %v\n", cmd, err)
		os.Exit(1)
	}
}

func runAgent(args []string) error {
	fs := flag.NewFlagSet("agent", flag.ExitOnError)
	path := fs.String("config", "/etc/shunt/hostd.hcl", "configuration file")
	fs.Parse(args)
	cfg, err := config.Load(*path)
	if err != nil {
		return err
	}
	log := hclog.New(&hclog.LoggerOptions{
		Name: "hostd", Level: hclog.LevelFromString(cfg.LogLevel), JSONFormat: cfg.LogFormat == "json",
		Output: os.Stderr, TimeFormat: time.RFC3339Nano,
	})
	// Signals are caught before the admin socket exists, so a reload
	// (SIGHUP) can never kill a hostd that already answers.
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGHUP, syscall.SIGINT, syscall.SIGTERM)
	a, err := agent.Start(log, cfg)
	if err != nil {
		return err
	}
	for s := range sigs {
		if s == syscall.SIGHUP {
			if _, err := a.Reload(); err != nil {
				log.Error("reload failed; keeping the old policy", "error", err)
			}
			continue
		}
		log.Info("stopping: moving connections to TCP", "signal", s)
		a.Shutdown()
		a.Close()
		return nil
	}
	return nil
}

// runCheck prints what `hostd check` finds and returns the exit code: 1 if
// there is a problem, else 0 (warnings too).
func runCheck(args []string) int {
	fs := flag.NewFlagSet("check", flag.ExitOnError)
	path := fs.String("config", "/etc/shunt/hostd.hcl", "configuration file")
	asJSON := fs.Bool("json", false, "print JSON")
	fs.Parse(args)
	if fs.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "usage: hostd check [-config FILE] [-json]\n")
		return 2
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	found := preflight.Run(ctx, *path, preflight.Host())
	write := preflight.WriteText
	if *asJSON {
		write = func(w io.Writer, fs []preflight.Finding) error { return preflight.WriteJSON(w, *path, fs) }
	}
	if err := write(os.Stdout, found); err != nil {
		fmt.Fprintf(os.Stderr, "hostd check: %v\n", err)
		return 1
	}
	if problems, _ := preflight.Count(found); problems > 0 {
		return 1
	}
	return 0
}

func runClient(cmd string, args []string) error {
	fs := flag.NewFlagSet(cmd, flag.ExitOnError)
	sock := fs.String("admin", "/run/shunt/admin.sock", "hostd admin socket")
	asJSON := fs.Bool("json", false, "print JSON")
	var control, iface, qmp string
	if cmd == admin.CmdMigrateIn {
		fs.StringVar(&control, "control", "", "the guest's new control socket (base path, as in the configuration)")
		fs.StringVar(&iface, "interface", "", "the guest's new host-side interface (its tap)")
		fs.StringVar(&qmp, "qmp", "", "the guest's new QMP socket (its QEMU's, as qmp in the configuration)")
	}
	fs.Parse(args)
	req := admin.Request{Cmd: cmd, Control: control, Interface: iface, QMP: qmp}
	if cmd == admin.CmdMigrateOut || cmd == admin.CmdMigrateIn {
		if fs.NArg() != 1 {
			return fmt.Errorf("usage: hostd %s GUEST", cmd)
		}
		req.Guest = fs.Arg(0)
	}
	if cmd == admin.CmdRevoke || cmd == admin.CmdDowngrade {
		if fs.NArg() != 1 {
			return fmt.Errorf("usage: hostd %s CONN", cmd)
		}
		req.Flow = fs.Arg(0)
	}
	var out json.RawMessage
	if err := admin.Call(*sock, req, &out); err != nil {
		return err
	}
	if *asJSON {
		fmt.Println(string(out))
		return nil
	}
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	defer tw.Flush()
	switch cmd {
	case admin.CmdGuests:
		var gs []broker.GuestInfo
		if err := json.Unmarshal(out, &gs); err != nil {
			return err
		}
		fmt.Fprintln(tw, "GUEST\tID\tGROUP\tSOURCE\tADDRESSES\tSESSIONS\tLISTENING\tFLOWS")
		for _, g := range gs {
			fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s\t%d\t%s\t%d\n", g.Name, g.ID, g.Group, g.Source, strings.Join(g.Addresses, ","), g.Sessions, strings.Join(g.Listening, ","), g.Flows)
		}
	case admin.CmdFlows:
		var fl []broker.FlowInfo
		if err := json.Unmarshal(out, &fl); err != nil {
			return err
		}
		fmt.Fprintln(tw, "CONN\tFLOW\tA\tB\tSRC\tDST\tPATH\tSWITCHES\tRING\tGUEST-SAID A>B\tGUEST-SAID B>A\tLEASE A>B\tLEASE B>A\tATTACHED\tRULE\tAGE")
		for _, f := range fl {
			path := f.Path
			if f.Via != "" && f.Path == "rings" {
				path = f.Via // the ring pair's other end is the relay to a peer host
			}
			if f.Reason != "" {
				path += "(" + f.Reason + ")"
			}
			flow := "-"
			if f.Name != f.Conn {
				flow = f.Name
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%d\t%d\t%d\t%d\t%d\t%d\t%s\t%s\t%s\n", f.Conn, flow, f.GuestA, f.GuestB, f.Src, f.Dst, path, f.Switches, f.Ring,
				f.RingsAB, f.RingsBA, f.LeaseAB, f.LeaseBA, f.Attached, f.Rule, time.Since(f.Created).Round(time.Second))
		}
	case admin.CmdStatus:
		var st agent.Status
		if err := json.Unmarshal(out, &st); err != nil {
			return err
		}
		fmt.Fprintf(tw, "uptime\t%s\nguests\t%d\nsessions\t%d\nconnections\t%d\nring pairs\t%d\ngroups\t%s\n", st.Uptime, st.Guests, st.Sessions, st.Conns, st.Flows, strings.Join(st.Groups, ","))
		if lv := st.Libvirt; lv != nil {
			conn := "connected"
			if !lv.Connected {
				conn = "disconnected: " + lv.LastError
			}
			fmt.Fprintf(tw, "libvirt\t%s\nlibvirt domains\t%s\nlibvirt syncs\t%d\n", conn, strings.Join(lv.Domains, ","), lv.Syncs)
		}
		for _, v := range st.Vsock {
			qemu := "no QEMU connected"
			if v.Connected {
				qemu = "QEMU connected"
			}
			by := ""
			if v.Daemon {
				by = " (shunt-vsockd's)"
			}
			fmt.Fprintf(tw, "vsock %s\tcid %d, %s, %d connections, %s%s\n", v.Guest, v.CID, qemu, v.Conns, v.Socket, by)
		}
	case admin.CmdCounters:
		var cs map[string]float64
		if err := json.Unmarshal(out, &cs); err != nil {
			return err
		}
		keys := make([]string, 0, len(cs))
		for k := range cs {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			fmt.Fprintf(tw, "%s\t%g\n", k, cs[k])
		}
	case admin.CmdPeers:
		var ps []peers.Info
		if err := json.Unmarshal(out, &ps); err != nil {
			return err
		}
		fmt.Fprintln(tw, "PEER\tADDRESS\tSTATE\tLINK\tPREFIXES\tANNOUNCED\tREFUSED\tFLOWS\tBYTES IN\tBYTES OUT\tRTT\tCONNECTS\tRELAY\tRELAYED IN\tRELAYED OUT\tZERO COPY OUT\tSTALLED\tERROR\tWHY TCP")
		for _, p := range ps {
			rl := peers.RelayInfo{Link: "-", Stalled: "-"}
			if p.Relay != nil {
				rl = *p.Relay
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%d\t%d\t%d\t%d\t%d\t%s\t%d\t%s\t%d\t%d\t%d\t%s\t%s\t%s\n", p.Name, p.Address, p.State, or(p.Link, "-"), strings.Join(p.Prefixes, ","),
				p.Announced, len(p.Refused), p.Flows, p.BytesIn, p.BytesOut, or(p.RTT, "-"), p.Reconnects, rl.Link, rl.BytesIn, rl.BytesOut, rl.Gathered, rl.Stalled, or(p.Error, "-"), rl.Why)
		}
	case admin.CmdMigrateOut, admin.CmdMigrateIn:
		var rep admin.MigrateReply
		if err := json.Unmarshal(out, &rep); err != nil {
			return err
		}
		if cmd == admin.CmdMigrateIn {
			fmt.Fprintf(tw, "guest %s: %d connections back on the rings now; the others follow as its library reconnects\n", rep.Guest, rep.Moved)
			break
		}
		fmt.Fprintf(tw, "guest %s: %d connections moved to TCP in %s\n", rep.Guest, rep.Moved, rep.Took)
		if rep.Unplugged > 0 {
			fmt.Fprintf(tw, "guest %s: %d pair regions unplugged\n", rep.Guest, rep.Unplugged)
		}
		if rep.Held > 0 {
			return fmt.Errorf("%d ring pairs still held: do not unplug the guest's ivshmem device yet (run migrate-out again)", rep.Held)
		}
		if rep.Plugged > 0 {
			return fmt.Errorf("%d pair regions still plugged into the VM: do not migrate it yet (run migrate-out again)", rep.Plugged)
		}
	default:
		fmt.Fprintln(tw, string(out))
	}
	return nil
}

func or(s, dflt string) string {
	if s == "" {
		return dflt
	}
	return s
}
