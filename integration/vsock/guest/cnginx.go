//go:build linux

package main

import (
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
)

// ngxConf is cnginx's nginx.conf: Debian's nginx (the host's /usr) with
// its workers as nobody, as a packaged nginx drops to www-data; every
// path it writes under dir (the initramfs has no /var).
const ngxConf = `user nobody nogroup;
worker_processes 1;
daemon off;
master_process on;
pid %[1]s/nginx.pid;
error_log stderr notice;
events { worker_connections 64; }
http {
	access_log off;
	client_body_temp_path %[1]s/body;
	proxy_temp_path %[1]s/proxy;
	fastcgi_temp_path %[1]s/fastcgi;
	uwsgi_temp_path %[1]s/uwsgi;
	scgi_temp_path %[1]s/scgi;
	sendfile on;
	server { listen %[2]d; root %[1]s/www; }
}
`

// cnginx starts nginx under shunt-run -v (no SHUNT_VSOCK: the VM's
// control channel is over vsock) serving /blob, n bytes of seed's stream,
// in the background until the VM stops; it returns once nginx listens
// on port (at most 30 s).
func cnginx(port uint32, n int64, seed uint64) error {
	dir := "/tmp/ngx"
	if err := os.MkdirAll(filepath.Join(dir, "www"), 0o755); err != nil {
		return err
	}
	// Who nobody is, for nginx's user directive.
	for file, line := range map[string]string{"/etc/passwd": "nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n", "/etc/group": "nogroup:x:65534:\n"} {
		f, err := os.OpenFile(file, os.O_APPEND|os.O_WRONLY, 0)
		if err != nil {
			return err
		}
		_, err = f.WriteString(line)
		f.Close()
		if err != nil {
			return err
		}
	}
	blob, err := os.OpenFile(filepath.Join(dir, "www", "blob"), os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o644)
	if err != nil {
		return err
	}
	_, err = io.CopyN(blob, rand.NewChaCha8(seedBytes(seed)), n)
	blob.Close()
	if err != nil {
		return err
	}
	conf := filepath.Join(dir, "nginx.conf")
	if err := os.WriteFile(conf, []byte(fmt.Sprintf(ngxConf, dir, port)), 0o644); err != nil {
		return err
	}
	cmd := exec.Command(filepath.Join(cdir, "shunt-run"), "-v", "nginx", "-e", "stderr", "-p", dir, "-c", conf)
	cmd.Env = append(os.Environ(), "SHUNT_PRELOAD="+filepath.Join(cdir, "libshunt-preload.so"))
	if err := startListening(cmd, "nginx", port); err != nil {
		return err
	}
	fmt.Printf("SHUNT-VSOCK cnginx port=%d listening\n", port)
	return nil
}
