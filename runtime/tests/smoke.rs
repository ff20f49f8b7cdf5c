use quiesce_runtime::net::{TcpListener, TcpStream};
use quiesce_runtime::{spawn_local, Runtime};

#[test]
fn echo_smoke() {
    let rt = Runtime::new().unwrap();
    eprintln!("driver {}", rt.driver_kind());
    rt.block_on(async {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let srv = spawn_local(async move {
            let (s, _) = l.accept().await.unwrap();
            let (r, buf) = s.read(vec![0u8; 64]).await;
            let n = r.unwrap();
            let (r, _) = s.write_all(buf[..n].to_vec()).await;
            r.unwrap();
        });
        let c = TcpStream::connect(addr).await.unwrap();
        let (r, _) = c.write_all(b"hello".to_vec()).await;
        r.unwrap();
        let (r, buf) = c.read_exact(Vec::with_capacity(5)).await;
        r.unwrap();
        assert_eq!(&buf[..], b"hello");
        srv.await.unwrap();
    });
}
